"""Read a model from any supported source and write it to any supported format.

Sources: a run directory (its latest checkpoint), a DCP checkpoint folder, a consolidated torch or safetensors file,
or a Hugging Face folder of a family with an adapter (Llama, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3,
GPT-2, ...). Targets: hf, dcp, torch, safetensors.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.hf import load_hf, save_hf
from forge.checkpoint.layout import mark_complete, resolve_checkpoint, step_dir
from forge.checkpoint.run_config import load_run_config
from forge.checkpoint.untrusted import load_dcp
from forge.models.spec import known_spec, spec_of

FORMATS = ("hf", "dcp", "torch", "safetensors")
_ARGS_KEY = "forge_args"
DEFAULT_TARGET = "forge.models.llama.args.TransformerArgs"
"""What a config without a model._target_ builds (configs saved before the model families had one)."""


def args_from_dict(model_cfg: dict, source: Path):
    """The model arguments of a checkpoint's `model` config, in the family its `_target_` names (one of forge's:
    the file is untrusted, nothing is imported from it)."""
    target = model_cfg.get("_target_", DEFAULT_TARGET)
    spec = known_spec(target)
    if spec is None:
        raise CheckpointError(f"{source}: model._target_={target!r} is not one of forge's model families")
    fields = {f.name for f in dataclasses.fields(spec.args)}
    return spec.args(**{k: v for k, v in model_cfg.items() if k in fields})


def empty_model(args) -> nn.Module:
    with torch.device("meta"):
        model = spec_of(args).build(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _load_dcp(path: Path) -> tuple[dict, object, Path]:
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise CheckpointError(f"checkpoint {path} has no config.yaml to build the model from")
    args = args_from_dict(yaml.safe_load(config_file.read_text())["model"], config_file)
    model = empty_model(args)
    state = {"model": model.state_dict()}
    load_dcp(state, path)
    return state["model"], args, path


def load_any(source: str | Path) -> tuple[dict[str, torch.Tensor], object, Path | None]:
    """(state dict in forge names, model args, the checkpoint folder when the source was DCP)."""
    src = Path(source).expanduser()
    if not src.exists():
        raise CheckpointError(f"{src} does not exist")
    if src.is_dir() and (src / "config.json").is_file():
        state, args = load_hf(src)
        return state, args, None
    if src.is_dir() and any(src.glob("*.safetensors")) and not (src / "checkpoints").is_dir():
        raise CheckpointError(f"{src} holds safetensors weights but no config.json (a Hugging Face folder needs both)")
    if src.is_file() and src.suffix == ".safetensors":
        return (*_load_safetensors(src), None)
    if src.is_file():
        try:
            blob = torch.load(src, weights_only=True, map_location="cpu")
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"cannot read {src}: {err}") from err
        if not isinstance(blob, dict) or "model" not in blob or "args" not in blob:
            raise CheckpointError(f"{src} is not a consolidated forge file (expected keys 'model' and 'args')")
        return blob["model"], args_from_dict(blob["args"], src), None
    return _load_dcp(resolve_checkpoint(src))


def _load_safetensors(src: Path) -> tuple[dict[str, torch.Tensor], object]:
    """A consolidated safetensors file that forge-convert wrote (its model args in the metadata)."""
    try:
        with safe_open(str(src), framework="pt") as f:
            meta = f.metadata() or {}
            if _ARGS_KEY not in meta:
                raise CheckpointError(f"{src} carries no '{_ARGS_KEY}' metadata (not written by forge-convert)")
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except SafetensorError as err:
        raise CheckpointError(f"{src} is not a readable safetensors file ({err})") from None
    try:
        return state, args_from_dict(json.loads(meta[_ARGS_KEY]), src)
    except (ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{src}: its '{_ARGS_KEY}' metadata is not forge model args ({err})") from None


def _copy_tokenizer(checkpoint: Path | None, source: Path, dst: Path) -> None:
    """Tokenizer files travel with an HF export: copied from an HF source, or rebuilt from the run's data config
    (whose `_target_` must be forge's own, see forge.checkpoint.run_config)."""
    for folder in [source] + ([checkpoint] if checkpoint else []):
        if folder.is_dir():
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (folder / name).is_file():
                    shutil.copy2(folder / name, dst / name)
    if checkpoint is None or (dst / "tokenizer.json").is_file():
        return
    data_cfg = load_run_config(checkpoint / "config.yaml").get("data")
    if not data_cfg or "_target_" not in data_cfg:
        return
    from hydra.utils import instantiate
    from transformers import PreTrainedTokenizerFast

    from forge.data.tokenizer import EOS

    corpus = instantiate(data_cfg)
    PreTrainedTokenizerFast(tokenizer_object=corpus.tokenizer, eos_token=EOS).save_pretrained(dst)


def save_as(fmt: str, state: dict[str, torch.Tensor], args: object, dst: Path) -> None:
    args_dict = {"_target_": spec_of(args).target, **dataclasses.asdict(args)}
    if fmt == "hf":
        save_hf(state, args, dst)
    elif fmt == "torch":
        dst.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": {k: v.contiguous() for k, v in state.items()}, "args": args_dict}, dst)
    elif fmt == "safetensors":
        dst.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous().clone() for k, v in state.items()}
        if args.tie_embeddings:
            tensors.pop("output.weight", None)
        save_file(tensors, str(dst), metadata={_ARGS_KEY: json.dumps(args_dict)})
    elif fmt == "dcp":
        path = step_dir(dst, 0)
        path.mkdir(parents=True, exist_ok=True)
        dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
        (path / "config.yaml").write_text(yaml.safe_dump({"model": args_dict}))
        mark_complete(dst, path)
    else:
        raise CheckpointError(f"--to {fmt!r} is not one of {', '.join(FORMATS)}")


def convert(fmt: str, source: str | Path, dst: str | Path, overwrite: bool = False) -> None:
    """Write `source` as `fmt` to `dst`. The output is written beside dst under a staging name and renamed into
    place when whole, so a failure leaves nothing behind; an existing dst is refused unless `overwrite`."""
    dst = Path(dst).expanduser()
    source_path = Path(source).expanduser().resolve()
    if source_path == dst.resolve() or dst.resolve() in source_path.parents:
        raise CheckpointError(f"{dst} is or holds the source {source}: write the conversion somewhere else")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        kind = "folder" if dst.is_dir() else "file"
        raise CheckpointError(f"{dst} already exists (a {kind}): choose a new destination or pass --overwrite")
    state, args, checkpoint = load_any(source)
    if args.tie_embeddings and "output.weight" not in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.parent / f".{dst.name}.staging-{os.getpid()}"
    try:
        save_as(fmt, state, args, staging)
        if fmt == "hf":
            _copy_tokenizer(checkpoint, Path(source), staging)
        old = dst.parent / f".{dst.name}.replaced-{os.getpid()}"
        if dst.exists() or dst.is_symlink():
            os.replace(dst, old)  # set aside, removed once the new output is in place
        os.replace(staging, dst)
        _remove(old)
    except BaseException:
        _remove(staging)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def load_pretrained(path: str | Path) -> nn.Module:
    """Our model with its weights, on CPU, in eval mode, from any source `forge-convert` reads."""
    state, args, _ = load_any(path)
    model = empty_model(args)
    if args.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "output.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (args.tie_embeddings and k == "output.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing keys {missing[:3]}, unexpected keys {unexpected[:3]}")
    return model.eval()
