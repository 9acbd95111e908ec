"""`forge-generate checkpoint=PATH prompt="..."`: text from a trained model, through the KV-cache engine.

Options are `key=value` pairs (OmegaConf dotlist syntax, checked against GenerateConfig), e.g.
    forge-generate checkpoint=outputs/run prompt='[ROMEO., JULIET.]' max_new_tokens=50 temperature=0.8 top_p=0.9
    forge-generate checkpoint=outputs/run interactive=true      # one prompt per line on stdin
    forge-generate checkpoint=outputs/vlm-run image=shape.png prompt='what color is the shape?'   # a VLM run
"""

import json
import sys
from dataclasses import dataclass
from typing import Any, Optional

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from forge.checkpoint.errors import CheckpointError
from forge.generate.engine import generate
from forge.generate.load import load, tokenizer_of
from forge.train.build import resolve_device


@dataclass
class GenerateConfig:
    """forge-generate's options."""

    checkpoint: str = MISSING
    """A run directory, DCP checkpoint folder, consolidated torch/safetensors file or Hugging Face folder."""
    prompt: Any = None
    """One prompt, taken verbatim (`prompt=ROMEO:` is the text "ROMEO:"), or a YAML list of plain values
    `prompt='[A, B]'`, prompts generated as one batch (other bracketed text, e.g. `[INST] hi [/INST]`, is one
    prompt)."""
    interactive: bool = False
    """Read prompts from stdin, one per line, until end of input."""
    max_new_tokens: int = 64
    """Tokens generated per prompt at most (fewer when EOS comes first)."""
    temperature: float = 0.0
    """0 is greedy decoding; above 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Sample only within the smallest set of tokens holding this much probability (1 = all)."""
    seed: int = 0
    """Seed of sampling; the same seed gives the same text."""
    stop_at_eos: bool = True
    """Stop a sequence at the tokenizer's end-of-document token."""
    tokenizer: Optional[str] = None
    """Override the tokenizer (gpt2, a tokenizer.json or a folder); default: the one the run trained with."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    format: str = "text"
    """text (prompt and completion) or jsonl (one {"prompt", "completion", "tokens"} object per prompt)."""
    image: Optional[str] = None
    """VLM checkpoints: the image the prompt asks about."""
    video: Optional[str] = None
    """VLM checkpoints: the video the prompt asks about (frames from clip_start to clip_end seconds)."""
    clip_start: float = 0.0
    """Start of the video clip in seconds."""
    clip_end: float = 2.0
    """End of the video clip in seconds."""


def parse(argv: list[str], schema: type) -> Any:
    """The schema's config with key=value overrides; exits with the message on a bad key or value."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(sys.modules[schema.__module__].__doc__)
        sys.exit(0)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(argv))
        OmegaConf.to_container(cfg, throw_on_missing=True)
    except OmegaConfBaseException as err:
        sys.exit(f"{sys.argv[0]}: {err}")
    return cfg


def split_prompts(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(the other arguments, the prompts): a prompt is text as typed, unless written as a [list]. Parsed as YAML
    like the other values, `prompt=ROMEO:` would be the mapping {ROMEO: None} and `prompt=3` a number."""
    rest, prompts = [], None
    for arg in argv:
        if not arg.startswith("prompt="):
            rest.append(arg)
            continue
        raw = arg.removeprefix("prompt=")
        prompts = _prompt_list(raw) or [raw]
    return rest, prompts


def _prompt_list(raw: str) -> list[str] | None:
    """The prompts of `[A, B]` when it is a YAML list of plain values; None for any other text (e.g. `[INST] hi`)."""
    if not (raw.startswith("[") and raw.endswith("]")):
        return None
    try:
        parsed = OmegaConf.from_dotlist([f"prompt={raw}"]).prompt
    except (OmegaConfBaseException, yaml.YAMLError):
        return None
    if not OmegaConf.is_list(parsed) or any(OmegaConf.is_config(p) for p in parsed):
        return None
    return [str(p) for p in parsed]


def check_sampling(cfg) -> None:
    """Exit naming the option when a sampling setting cannot work."""
    rules = [
        ("max_new_tokens", cfg.max_new_tokens >= 1, "must be at least 1"),
        ("temperature", cfg.temperature >= 0, "must be >= 0 (0 is greedy)"),
        ("top_k", cfg.top_k >= 0, "must be >= 0 (0 keeps all tokens)"),
        ("top_p", 0 < cfg.top_p <= 1, "must be in (0, 1] (1 keeps all tokens)"),
    ]
    for key, ok, rule in rules:
        if not ok:
            sys.exit(f"forge-generate: {key}={cfg[key]} {rule}")
    if cfg.format not in ("text", "jsonl"):
        sys.exit(f"forge-generate: format={cfg.format!r} is not one of text, jsonl")


def main(argv: list[str] | None = None) -> int:
    args, prompts = split_prompts(sys.argv[1:] if argv is None else argv)
    cfg = parse(args, GenerateConfig)
    if prompts is not None:
        cfg.prompt = prompts
    check_sampling(cfg)
    device = resolve_device(cfg.device)
    if cfg.image is not None or cfg.video is not None:
        return generate_about_media(cfg, device)
    try:
        loaded = load(cfg.checkpoint, device)
        tokenizer, eos_id = tokenizer_of(cfg.checkpoint, loaded.run_config, cfg.tokenizer)
    except (CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"forge-generate: {err}", file=sys.stderr)
        return 1

    def run(prompts: list[str]) -> None:
        ids = [tokenizer.encode(p).ids for p in prompts]
        outs = generate(
            loaded.model,
            ids,
            cfg.max_new_tokens,
            cfg.temperature,
            cfg.top_k,
            cfg.top_p,
            eos_id if cfg.stop_at_eos else None,
            cfg.seed,
        )
        for prompt, out in zip(prompts, outs):
            completion = tokenizer.decode(out)
            if cfg.format == "jsonl":
                print(json.dumps({"prompt": prompt, "completion": completion, "tokens": out}), flush=True)
            else:
                print(prompt + completion, end="\n\n", flush=True)

    try:
        if cfg.interactive:
            for line in sys.stdin:
                if line.strip():
                    run([line.rstrip("\n")])
            return 0
        if cfg.prompt is None:
            sys.exit("forge-generate: give prompt=TEXT, prompt='[A, B]' or interactive=true")
        prompts = list(cfg.prompt) if OmegaConf.is_list(cfg.prompt) else [str(cfg.prompt)]
        run([str(p) for p in prompts])
    except ValueError as err:  # empty prompt, too long for max_seq_len
        print(f"forge-generate: {err}", file=sys.stderr)
        return 1
    return 0


def generate_about_media(cfg, device) -> int:
    """A VLM checkpoint answering each prompt about cfg.image or cfg.video."""
    from forge.data.vlm.dataset import MediaRecord
    from forge.data.vlm.media import MediaError
    from forge.generate.vlm import generate_vlm, load_vlm

    if cfg.prompt is None:
        sys.exit("forge-generate: give prompt=TEXT with image= or video=")
    try:
        model, corpus, _ = load_vlm(cfg.checkpoint, device)
        prompts = list(cfg.prompt) if OmegaConf.is_list(cfg.prompt) else [str(cfg.prompt)]
        for prompt in prompts:
            if cfg.image is not None:
                record = MediaRecord(str(cfg.image), str(prompt), "")
            else:
                record = MediaRecord(str(cfg.video), str(prompt), "", cfg.clip_start, cfg.clip_end)
            corpus.on_bad_media = "error"
            out = generate_vlm(
                model,
                corpus,
                record,
                cfg.max_new_tokens,
                cfg.temperature,
                cfg.top_k,
                cfg.top_p,
                cfg.stop_at_eos,
                cfg.seed,
            )
            completion = corpus.tokenizer.decode(out)
            if cfg.format == "jsonl":
                print(json.dumps({"prompt": prompt, "completion": completion, "tokens": out}), flush=True)
            else:
                print(f"{prompt} {completion}", flush=True)
    except (CheckpointError, FileNotFoundError, MediaError, ValueError) as err:
        print(f"forge-generate: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
