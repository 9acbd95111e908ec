"""`forge-eval checkpoint=PATH [data=OPTION]`: held-out loss and perplexity, through the trainer's own `evaluate`.

The validation split, sequence length and batch count default to the run's own config (the checkpoint's
config.yaml); `data=NAME` evaluates on another option of conf/data instead, e.g.
    forge-eval checkpoint=outputs/run batches=16
    forge-eval checkpoint=outputs/run data=memmap 'data_overrides=[data.path=data/c4, data.vocab_size=50257]'
    forge-eval checkpoint=outputs/run 'capture=[layers.*]' capture_out=acts.safetensors
"""

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Optional

from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig
from torch import nn

from forge.checkpoint.errors import CheckpointError
from forge.config import ConfigError, compose
from forge.config.resolve import fill_vocab_from_data_meta
from forge.config.validate import validate_required
from forge.data.loader import TokenWindows, eval_batches
from forge.generate.activations import capture_activations, save_activations
from forge.generate.cli import parse
from forge.generate.load import build_corpus, load
from forge.train.build import resolve_device
from forge.train.precision import resolve_dtype
from forge.train.steps.text import evaluate


@dataclass
class EvalConfig:
    """forge-eval's options."""

    checkpoint: str = MISSING
    """A run directory, DCP checkpoint folder, consolidated torch/safetensors file or Hugging Face folder."""
    data: Optional[str] = None
    """An option of conf/data to evaluate on; default: the run's own data config (embedded for other sources)."""
    data_overrides: list[str] = field(default_factory=list)
    """Overrides composed with `data`, e.g. [data.path=..., data.vocab_size=...]."""
    batches: Optional[int] = None
    """Validation micro-batches; default: the run's train.eval_batches."""
    seq_len: Optional[int] = None
    """Tokens per sample; default: the run's train.seq_len."""
    micro_batch_size: Optional[int] = None
    """Samples per batch; default: the run's train.micro_batch_size (its global batch when that was automatic)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: str = "fp32"
    """fp32, bf16 or auto, as train.dtype."""
    capture: list[str] = field(default_factory=list)
    """Module name patterns (globs, e.g. layers.*) whose outputs are recorded over the evaluated batches."""
    capture_out: str = "activations.safetensors"
    """Where captured activations are written."""


def eval_setup(cfg: EvalConfig, run_config: DictConfig | None) -> tuple[DictConfig, int, int, int]:
    """(data config, seq_len, micro batch, batches): the options given, else the run's, else forge-train's defaults."""
    defaults = compose([f"data={cfg.data}", *cfg.data_overrides] if cfg.data else list(cfg.data_overrides))
    base = run_config if run_config is not None and "train" in run_config else defaults
    data = defaults.data if cfg.data or run_config is None or "data" not in run_config else run_config.data

    def given_or(value: int | None, default: int) -> int:
        return default if value is None else value

    return (
        data,
        given_or(cfg.seq_len, base.train.seq_len),
        given_or(cfg.micro_batch_size, base.train.micro_batch_size or base.train.global_batch_size),
        given_or(cfg.batches, base.train.eval_batches),
    )


def check_sizes(seq_len: int, micro_batch: int, batches: int, max_seq_len: int | None) -> None:
    """Raise ValueError naming the option that cannot work."""
    for key, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch), ("batches", batches)):
        if value < 1:
            raise ValueError(f"{key}={value} must be at least 1")
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}")


def held_out_loss(
    model: nn.Module,
    corpus,
    seq_len: int,
    micro_batch: int,
    count: int,
    device,
    dtype: str,
    document_eos: int | None = None,
) -> float:
    """Mean validation loss over the first `count` micro-batches, as the trainer's in-training eval computes it."""
    windows = TokenWindows(corpus.val_tokens, seq_len)
    return evaluate(model, eval_batches(windows, micro_batch, count, document_eos=document_eos), device, dtype)


def main(argv: list[str] | None = None) -> int:
    cfg = parse(sys.argv[1:] if argv is None else argv, EvalConfig)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    try:
        loaded = load(cfg.checkpoint, device)
        data, seq_len, micro_batch, count = eval_setup(cfg, loaded.run_config)
        check_sizes(seq_len, micro_batch, count, getattr(getattr(loaded.model, "args", None), "max_seq_len", None))
        fill_vocab_from_data_meta(data)
        validate_required(data, "data.")
        corpus = build_corpus(data)
        eos = getattr(corpus, "document_eos", None)
        loss = held_out_loss(loaded.model, corpus, seq_len, micro_batch, count, device, dtype, eos)
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError, HydraException) as err:
        # HydraException: a bad data=NAME or data_overrides entry, or a data error raised while instantiating
        print(f"forge-eval: {err}", file=sys.stderr)
        return 1
    windows = TokenWindows(corpus.val_tokens, seq_len)
    used = min(count, len(windows) // micro_batch) or 1
    result = {
        "loss": loss,
        "perplexity": math.exp(loss),
        "batches": used,
        "tokens": used * micro_batch * seq_len,
        "seq_len": seq_len,
    }
    if cfg.capture:
        inputs = (batch[0] for batch in eval_batches(windows, micro_batch, count))
        save_activations(capture_activations(loaded.model, inputs, list(cfg.capture)), cfg.capture_out)
        result["activations"] = cfg.capture_out
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
