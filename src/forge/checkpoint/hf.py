"""Hugging Face folders, whatever the model family: which family a folder holds (config.json's model_type, among
the families' specs), its config as the family's arguments, and whole-state save and load (forge-convert). The
names, configs and layouts are the family's adapter's (forge.models.spec.HFAdapter); a parallelized model reads
and writes one tensor at a time instead (forge.checkpoint.hf_load, hf_save).
"""

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from forge.checkpoint.errors import CheckpointError
from forge.domain import out_of_domain
from forge.models.spec import ModelSpec, families, spec_of

INDEX = "model.safetensors.index.json"
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
DEFAULT_MODEL_TYPE = "llama"
"""What a config.json without a model_type is (early Llama exports)."""


def read_config_json(config_file: Path) -> dict:
    """config.json as a dict; a file that is not JSON, not text or not an object is named."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file}:{err.lineno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{config_file} is not a text file (not valid UTF-8)") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a model config (a JSON object)")
    return config


def spec_of_config(config: dict, config_file: Path) -> ModelSpec:
    """The family whose adapter reads this config's model_type."""
    model_type = config.get("model_type") or DEFAULT_MODEL_TYPE
    known = {t: spec for spec in families() if spec.hf is not None for t in spec.hf.model_types}
    if model_type not in known:
        raise CheckpointError(f"{config_file}: model_type {model_type!r} is not supported ({', '.join(known)} only)")
    return known[model_type]


def read_hf_config(config_file: Path):
    """The model arguments of a config.json, in whichever family reads it; what is unusable is named."""
    config = read_config_json(config_file)
    spec = spec_of_config(config, config_file)
    kinds = f"{spec.name} ({', '.join(spec.hf.model_types)})"
    try:
        args = spec.hf.config_to_args(config)
    except KeyError as err:
        raise CheckpointError(f"{config_file} lacks {err.args[0]!r}, which a {kinds} config has") from None
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise CheckpointError(f"{config_file} is not a usable {kinds} config ({err})") from None
    fault = out_of_domain(args, "model.")
    if fault:
        raise CheckpointError(f"{config_file} is not a usable {kinds} config: it gives {fault}")
    return args


class HFWeights:
    """The safetensors files of a folder, opened (headers only) and indexed by tensor name; counts bytes read."""

    def __init__(self, folder: Path, stack: ExitStack):
        self.folder = folder
        self.config = read_config_json(folder / "config.json")
        """The folder's config.json (an adapter reads layout flags from it: DeepSeek-V3's rope_interleave)."""
        self.files: dict[str, Path] = {}
        self._handles = {}
        self.bytes_read = 0
        for file in _weight_files(folder):
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt"))
                names = list(handle.keys())
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error type for a bad header
                raise CheckpointError(f"cannot read {file}: {err}") from err
            for name in names:
                if name in self.files:
                    raise CheckpointError(
                        f"{folder}: tensor {name!r} is in both {self.files[name].name} and {file.name}"
                    )
                self.files[name], self._handles[name] = file, handle

    @property
    def total_bytes(self) -> int:
        return sum(self._size(name) for name in self.files)

    def _size(self, name: str) -> int:
        piece = self._handles[name].get_slice(name)
        return _BYTES.get(piece.get_dtype(), 4) * torch.Size(piece.get_shape()).numel()

    def read(self, name: str, shape: tuple[int, ...], box: tuple[slice, ...]) -> torch.Tensor:
        """The `box` of tensor `name`, which must have `shape`."""
        if name not in self._handles:
            raise CheckpointError(f"{self.folder} has no tensor {name!r}")
        piece = self._handles[name].get_slice(name)
        stored = tuple(piece.get_shape())
        if stored != shape:
            raise CheckpointError(f"{self.files[name]}: {name} has shape {stored}, the model expects {shape}")
        try:
            out = piece[box]
        except Exception as err:  # noqa: BLE001 - a file cut short after its header
            raise CheckpointError(f"cannot read {name} from {self.files[name]}: {err}") from err
        self.bytes_read += out.numel() * out.element_size()
        return out


def _weight_files(folder: Path) -> list[Path]:
    """The index's files when there is one (a folder may hold other weights too, e.g. consolidated.safetensors)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"cannot read {index}: {err}") from err
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names {missing[0]}, which is not in {folder}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds config.json but no *.safetensors weights (the only format read here)")
    return files


def hf_adapter(args):
    """The Hugging Face adapter of a model's family; CheckpointError when the family has none."""
    spec = spec_of(args)
    if spec.hf is None:
        raise CheckpointError(f"the {spec.name} model family has no Hugging Face format")
    return spec.hf


def whole_shapes(args) -> dict[str, torch.Size]:
    """Every parameter's whole shape, from the model built on the meta device (a tied head left out)."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in spec_of(args).build(args).state_dict().items()}
    if args.tie_embeddings:
        shapes.pop("output.weight", None)
    return shapes


def save_hf(state: dict[str, torch.Tensor], args, out_dir: Path) -> None:
    """Write config.json + model.safetensors that transformers' from_pretrained loads."""
    adapter = hf_adapter(args)
    config = adapter.args_to_config(args)  # before writing anything: an unsupported model leaves no folder behind
    tensors = {}
    for key, shape in whole_shapes(args).items():
        value = state[key].detach().to(torch.float32)
        for (name, _), part in zip(adapter.entries(key, tuple(shape), args), adapter.to_hf(key, value, args)):
            tensors[name] = part.contiguous().clone()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], object]:
    """Read a Hugging Face folder of any family: (forge state dict, args)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    args = read_hf_config(config_file)
    adapter = hf_adapter(args)
    state = {}
    with ExitStack() as stack:
        weights = HFWeights(folder, stack)
        for key, shape in whole_shapes(args).items():
            state[key] = adapter.read(key, tuple(shape), tuple(slice(0, n) for n in shape), weights, args).clone()
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state, args
