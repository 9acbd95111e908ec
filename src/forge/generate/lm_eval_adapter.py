"""lm-evaluation-harness on forge checkpoints: the model class `forge`, and a command line around simple_evaluate.

Importing this module registers the class, so in Python:
    import lm_eval, forge.generate.lm_eval_adapter
    lm_eval.simple_evaluate(model="forge", model_args="checkpoint=outputs/run,batch_size=8", tasks=[...])
model_args: checkpoint (any layout forge-eval reads), device (auto|cpu|cuda), dtype (fp32|bf16|auto), batch_size,
max_length (default: the model's max_seq_len), tokenizer (default: the run's own).

From the shell, options as `key=value` pairs (see LmEvalConfig):
    python -m forge.generate.lm_eval_adapter checkpoint=outputs/run                       # the forge_shakespeare tasks
    python -m forge.generate.lm_eval_adapter checkpoint=outputs/run 'tasks=[forge_shakespeare_ppl]' limit=50
    python -m forge.generate.lm_eval_adapter checkpoint=outputs/run 'tasks=[hellaswag]'  # lm-eval's own (hub) tasks
The local tasks (forge/generate/lm_eval_tasks.py) are written to a temporary folder and searched with include_path;
lm-eval's ~15k built-in tasks are indexed (slow) only when a task is not found locally.
"""

import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lm_eval import simple_evaluate
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager
from omegaconf import MISSING

from forge.checkpoint.errors import CheckpointError
from forge.generate.cli import parse
from forge.generate.engine import generate
from forge.generate.load import load, tokenizer_of
from forge.train.build import resolve_device
from forge.train.precision import autocast, resolve_dtype

# (request key for the cache hook or None, context token ids, continuation token ids)
TokenRequest = tuple[Any, list[int], list[int]]


@register_model("forge")
class ForgeLM(TemplateLM):
    """A forge checkpoint as an lm-eval model in one process; batches right-padded to score, left-padded to generate."""

    def __init__(
        self,
        checkpoint: str,
        device: str = "auto",
        dtype: str = "fp32",
        batch_size: int | str = 8,
        max_length: Optional[int] = None,
        tokenizer: Optional[str] = None,
        max_gen_toks: int = 256,
        max_batch_size: Optional[int] = None,
    ):
        """max_batch_size is accepted for lm-eval's CLI and ignored: batch_size=auto is not supported."""
        super().__init__()
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size!r}: give a positive number (auto is not supported)")
        self._device = resolve_device(str(device))
        self.dtype = resolve_dtype(dtype, self._device)
        loaded = load(checkpoint, self._device)
        self.model = loaded.model.eval()
        self.tokenizer, self.eos_id = tokenizer_of(checkpoint, loaded.run_config, tokenizer)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or self.model.args.max_seq_len)
        if not 0 < self.max_length <= self.model.args.max_seq_len:
            raise ValueError(
                f"max_length={max_length} is not within the model's max_seq_len={self.model.args.max_seq_len}"
            )
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        """The end-of-document id: the context of an empty prompt and of a document's first window."""
        return self.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string`; no special tokens unless asked for, as lm-eval does for causal HF models."""
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def tok_decode(self, tokens: list[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits (batch, longest row, vocab); rows are right-padded, which causal attention never lets them see."""
        tokens = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        with autocast(self._device, self.dtype):
            return self.model(tokens.to(self._device))

    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs):
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per request.

        The context is cut from the left so that context + continuation fits max_length + 1 tokens (the last token
        is never an input). Requests run longest first, batch_size at a time.
        """
        inputs, results = [], [None] * len(requests)
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length")
            inputs.append((context + continuation)[-(self.max_length + 1) :][:-1])
        order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            logits = self._forward([inputs[i] for i in batch])
            for row, i in enumerate(batch):
                key, _, continuation = requests[i]
                end = len(inputs[i])
                logprobs = F.log_softmax(logits[row, end - len(continuation) : end].float(), dim=-1)
                target = torch.tensor(continuation, device=logprobs.device)
                score = float(logprobs.gather(-1, target[:, None]).sum())
                greedy = bool((logprobs.argmax(dim=-1) == target).all())
                results[i] = (score, greedy)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[i])
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document, after EOS, in disjoint windows of max_length predicted tokens.

        Every token is predicted once; a window after the first sees the max_length tokens before its last one.
        """
        windows: list[TokenRequest] = []
        owner: list[int] = []
        for index, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (score, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[index] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy text (sampled when do_sample and temperature > 0) cut before the first `until` string.

        Generation stops at EOS or after max_gen_toks tokens; the context keeps its last max_length - max_gen_toks
        tokens. Requests with the same generation arguments run together, longest first, batch_size at a time.
        """
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True)].append(i)
        results: list[str] = [""] * len(requests)
        for key, members in groups.items():
            kwargs = json.loads(key)
            until = kwargs.get("until") or [self.tok_decode([self.eos_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            if max_new >= self.max_length:
                raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in max_length")
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            prompts = {
                i: (self.tok_encode(requests[i].args[0]) or [self.eos_id])[-(self.max_length - max_new) :]
                for i in members
            }
            order = sorted(members, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                with autocast(self._device, self.dtype):
                    outs = generate(self.model, [prompts[i] for i in batch], max_new, temperature, eos_id=self.eos_id)
                for i, out in zip(batch, outs):
                    text = self.tok_decode(out)
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results


@dataclass
class LmEvalConfig:
    """Options of `python -m forge.generate.lm_eval_adapter`."""

    checkpoint: str = MISSING
    """A run directory, DCP checkpoint folder, consolidated torch/safetensors file or Hugging Face folder."""
    tasks: list[str] = field(default_factory=lambda: ["forge_shakespeare"])
    """lm-eval task, group or tag names; forge_shakespeare is the three local tasks."""
    include_path: Optional[str] = None
    """A folder of extra task YAMLs, searched with the local tasks (written to a temporary folder)."""
    task_docs: int = 200
    """Documents per local task when they are written here."""
    limit: Optional[float] = None
    """Documents per task at most (a fraction below 1)."""
    num_fewshot: Optional[int] = None
    """Few-shot examples per prompt; default: each task's own."""
    batch_size: int = 8
    """Sequences per forward pass."""
    max_length: Optional[int] = None
    """Context window in tokens; default: the model's max_seq_len."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: str = "fp32"
    """fp32, bf16 or auto, as train.dtype."""
    tokenizer: Optional[str] = None
    """Override the tokenizer (gpt2, a tokenizer.json or a folder); default: the one the run trained with."""
    bootstrap_iters: int = 1000
    """Bootstrap resamples for the standard errors of non-mean metrics (0 skips them)."""
    output: Optional[str] = None
    """Also write lm-eval's full results (configs, versions, metrics) to this JSON file."""


def task_manager(tasks: list[str], include_path: list[str]) -> TaskManager:
    """A TaskManager over the `include_path` folders, plus lm-eval's built-in tasks when a task is not found there."""
    manager = TaskManager(include_path=include_path, include_defaults=False)
    if all(task in manager.all_tasks for task in tasks):
        return manager
    return TaskManager(include_path=include_path)


def evaluate_tasks(cfg: LmEvalConfig, include_path: list[str]) -> dict:
    """lm_eval.simple_evaluate's results for the configured checkpoint and tasks."""
    model_args = {"checkpoint": cfg.checkpoint, "device": cfg.device, "dtype": cfg.dtype, "batch_size": cfg.batch_size}
    if cfg.max_length:
        model_args["max_length"] = cfg.max_length
    if cfg.tokenizer:
        model_args["tokenizer"] = cfg.tokenizer
    tasks = list(cfg.tasks)
    return simple_evaluate(
        model="forge",
        model_args=model_args,
        tasks=tasks,
        task_manager=task_manager(tasks, include_path),
        limit=cfg.limit,
        num_fewshot=cfg.num_fewshot,
        bootstrap_iters=cfg.bootstrap_iters,
        log_samples=False,
    )


def main(argv: list[str] | None = None) -> int:
    from forge.generate.lm_eval_tasks import write_tasks

    cfg = parse(sys.argv[1:] if argv is None else argv, LmEvalConfig)
    with tempfile.TemporaryDirectory(prefix="forge-lm-eval-") as tmp:
        include_path = [str(write_tasks(tmp, cfg.task_docs)), *([cfg.include_path] if cfg.include_path else [])]
        try:
            results = evaluate_tasks(cfg, include_path)
        except (CheckpointError, FileNotFoundError, ValueError, KeyError) as err:  # KeyError: an unknown task
            print(f"forge lm-eval: {err}", file=sys.stderr)
            return 1
    if cfg.output:
        with open(cfg.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
    print(json.dumps(results["results"], indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
