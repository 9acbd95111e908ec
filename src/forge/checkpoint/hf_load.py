"""Warm start from a Hugging Face Llama, Qwen3, Mixtral, Qwen3-MoE or (dense) DeepSeek-V3 folder straight into a
parallelized model.

Each rank reads only the box of every weight it holds (FSDP and TP shards, expert-parallel slices, the blocks of
its pipeline stages) with safetensors' `get_slice` on the memory-mapped files, and hands the model one unit
(embedding, one block, norm, head) at a time: no rank reads a tensor it does not hold or builds the whole state
dict. Names follow forge.checkpoint.hf: the per-expert Linears of Mixtral and Qwen3-MoE are the transposed slices of
our stacked expert weights. Rotary rows need no permutation, except DeepSeek-V3's interleaved ones
(forge.checkpoint.hf_config.rope_row_order): a rank reads the whole rows of those (its columns only) and reorders.
"""

import json
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.hf import forge_to_hf_key, hf_expert, hf_to_forge_key
from forge.checkpoint.hf_config import (
    QWEN3_MOE,
    family_of,
    moe_unsupported,
    read_hf_config,
    rope_interleaved,
    rope_row_order,
)
from forge.checkpoint.stages import whole_model_keys, whole_model_names
from forge.models.llama import Transformer, TransformerArgs
from forge.parallel.init import plain_name

log = logging.getLogger("forge")

INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer that old Llama exports saved; recomputed from rope_theta
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def is_hf_folder(source: str | Path) -> bool:
    """A Hugging Face model folder (config.json beside the weights), not a forge run or DCP checkpoint."""
    path = Path(source).expanduser()
    forge_layout = (path / "checkpoints").is_dir() or (path / ".metadata").is_file()
    return path.is_dir() and (path / "config.json").is_file() and not forge_layout


def decoder_args(model: nn.Module) -> TransformerArgs:
    """The args of the text decoder `model` is (or whose pipeline stages it holds); CheckpointError otherwise."""
    first = model[0] if isinstance(model, nn.ModuleList) else model
    if not isinstance(first, Transformer):
        raise CheckpointError(f"Hugging Face weights fit forge's text decoder only, not a {type(first).__name__}")
    return first.args


class HFWeights:
    """The safetensors files of a folder, opened (headers only) and indexed by tensor name; counts bytes read."""

    def __init__(self, folder: Path, stack: ExitStack):
        self.folder = folder
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


@dataclass(frozen=True)
class _Field:
    ours: str  # attribute of TransformerArgs (dotted for MoE)
    hf: str  # key in config.json
    setting: str  # the config field a user would change


_SHAPE_FIELDS = (
    _Field("dim", "hidden_size", "model.dim"),
    _Field("n_layers", "num_hidden_layers", "model.n_layers"),
    _Field("n_heads", "num_attention_heads", "model.n_heads"),
    _Field("kv_heads", "num_key_value_heads", "model.n_kv_heads"),
    _Field("vocab_size", "vocab_size", "model.vocab_size"),
    _Field("norm_eps", "rms_norm_eps", "model.norm_eps"),
)
_MOE_FIELDS = (
    _Field("num_experts", "num_local_experts", "model.moe.num_experts"),
    _Field("top_k", "num_experts_per_tok", "model.moe.top_k"),
    _Field("every", "decoder_sparse_step", "model.moe.every"),
    _Field("first_dense", "first_k_dense_replace", "model.moe.first_dense"),
    _Field("expert_groups", "n_group", "model.moe.expert_groups"),
    _Field("groups_per_token", "topk_group", "model.moe.groups_per_token"),
    _Field("route_scale", "routed_scaling_factor", "model.moe.route_scale"),
)
_SOFT_FIELDS = ("rope_theta", "rope_scaling")  # a longer context changes them on purpose


def check_hf_config(folder: Path, args: TransformerArgs) -> None:
    """config.json describes the model of `args`: CheckpointError naming the first field that differs."""
    config_file = folder / "config.json"
    theirs = read_hf_config(config_file)

    def differs(hf_key: str, their_value, setting: str, our_value) -> CheckpointError:
        return CheckpointError(
            f"{config_file} has {hf_key}={their_value} but {setting}={our_value}: the weights do not fit this model"
        )

    mla = args.attention_kind == "mla"  # n_kv_heads and head_dim do not apply: model.mla's widths do
    for f in _SHAPE_FIELDS:
        if mla and f.ours == "kv_heads":
            continue
        if getattr(args, f.ours) != getattr(theirs, f.ours):
            raise differs(f.hf, getattr(theirs, f.ours), f.setting, getattr(args, f.ours))
    if not mla and args.head_size != theirs.head_size:
        raise differs("head_dim", theirs.head_size, "model.head_dim", args.head_size)
    family = family_of(theirs)
    if (args.moe is None) != (theirs.moe is None):
        ours = "null (a dense model)" if args.moe is None else "set (an MoE model)"
        raise differs("model_type", family.model_type, "model.moe", ours)
    if args.qk_norm != theirs.qk_norm:
        raise differs("model_type", family.model_type, "model.qk_norm", args.qk_norm)
    if args.attention_kind != theirs.attention_kind:
        raise differs("model_type", family.model_type, "model.attention_kind", args.attention_kind)
    if args.attention_kind == "mla" and args.mla != theirs.mla:
        field = next(k for k in vars(args.mla) if getattr(args.mla, k) != getattr(theirs.mla, k))
        raise differs(field, getattr(theirs.mla, field), f"model.mla.{field}", getattr(args.mla, field))
    has_dense_blocks = args.moe is None or args.moe.every > 1 or args.moe.first_dense > 0
    if has_dense_blocks and args.hidden_dim != theirs.hidden_dim:
        raise differs("intermediate_size", theirs.hidden_dim, "model.ffn_dim", args.hidden_dim)
    if args.moe is not None:
        reason = moe_unsupported(args.moe, family)
        if reason:
            raise CheckpointError(f"{reason}: {family.architecture} weights in {folder} do not fit this model")
        for f in _MOE_FIELDS:
            if getattr(args.moe, f.ours) != getattr(theirs.moe, f.ours):
                raise differs(f.hf, getattr(theirs.moe, f.ours), f.setting, getattr(args.moe, f.ours))
        expert_dim = args.moe.expert_ffn_dim or args.hidden_dim
        if expert_dim != theirs.moe.expert_ffn_dim:
            hf_key = "moe_intermediate_size" if family is QWEN3_MOE else "intermediate_size"
            raise differs(hf_key, theirs.moe.expert_ffn_dim, "model.moe.expert_ffn_dim", expert_dim)
    if args.tie_embeddings and not theirs.tie_embeddings:
        raise differs("tie_word_embeddings", False, "model.tie_embeddings", True)
    soft = [name for name in _SOFT_FIELDS if getattr(args, name) != getattr(theirs, name)]
    for name in soft:
        log.warning(
            "%s has another %s (%s) than model.%s=%s: loading anyway",
            config_file,
            name,
            getattr(theirs, name),
            name,
            getattr(args, name),
        )


def _box(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(global shape, the slices of it this rank holds)."""
    if not isinstance(value, DTensor):
        return tuple(value.shape), tuple(slice(0, n) for n in value.shape)
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape) != tuple(value.to_local().shape):  # a layout whose local part is not one box of the whole
        raise CheckpointError(f"cannot tell which part of the tensor this rank holds (placements {value.placements})")
    return tuple(value.shape), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _hf_names(key: str, args: TransformerArgs) -> str | list[str]:
    """The HF tensor our `key` reads (experts: one per expert, each the transpose of a slice)."""
    family, parts = family_of(args), key.split(".")
    if len(parts) == 5 and parts[2:4] == ["feed_forward", "experts"]:
        return [family.expert_key(parts[1], e, parts[4]) for e in range(args.moe.num_experts)]
    return forge_to_hf_key(key, family)


def _read(
    weights: HFWeights, key: str, value: torch.Tensor, args: TransformerArgs, interleaved: bool = False
) -> torch.Tensor:
    """This rank's part of our `key` from the HF tensors, in `value`'s dtype and device (`interleaved`: the
    folder's rotary rows are DeepSeek's interleaved pairs)."""
    shape, box = _box(value)
    names = _hf_names(key, args)
    order = rope_row_order(key, args) if interleaved else None
    if order is not None:
        rows = weights.read(names, shape, (slice(0, shape[0]), *box[1:]))  # all rows: this rank's may come from any
        local = rows[order][box[0]]
    elif isinstance(names, str):
        if key == "output.weight" and names not in weights.files:
            names = "model.embed_tokens.weight"  # tied in the folder, untied here: the head starts as a copy
        local = weights.read(names, shape, box)
    else:
        experts, rows, cols = box
        pieces = [
            weights.read(names[e], (shape[2], shape[1]), (cols, rows)).T for e in range(*experts.indices(shape[0]))
        ]
        size = (experts.stop - experts.start, rows.stop - rows.start, cols.stop - cols.start)
        local = torch.stack(pieces) if pieces else torch.empty(size)
    local = local.to(device=value.device, dtype=value.dtype)
    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())


def _unit(key: str) -> str:
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _check_keys(weights: HFWeights, wanted: set[str], known: set[str], exclude: tuple[str, ...]) -> None:
    """Every wanted key has its tensors in the folder, and the folder holds nothing this model lacks."""
    provided = set()
    for name in weights.files:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        expert = hf_expert(name)
        if expert:
            layer, _, stacked = expert
            provided.add(f"layers.{layer}.feed_forward.experts.{stacked}")
        else:
            provided.add(hf_to_forge_key(name))
    if "model.embed_tokens.weight" in weights.files:
        provided.add("output.weight")  # a tied folder: see _read
    missing = sorted(wanted - provided)
    if missing:
        raise CheckpointError(
            f"{weights.folder} has no weights for '{missing[0]}' ({len(missing)} model keys missing in all; "
            "checkpoint.load_weights_exclude leaves keys at their initial values)"
        )
    unexpected = sorted(k for k in provided - known if not k.startswith(exclude))
    if unexpected:
        raise CheckpointError(f"{weights.folder} has weights for '{unexpected[0]}', which this model does not have")


def load_hf_into(model: nn.Module, folder: str | Path, exclude: tuple[str, ...] = ()) -> int:
    """Fill `model` (parallelized or not) with the weights of a Hugging Face folder, keys starting with an `exclude`
    prefix left as they are. Every rank calls it (no collective runs); returns the bytes this rank read."""
    folder = Path(folder).expanduser()
    args = decoder_args(model)
    check_hf_config(folder, args)
    interleaved = rope_interleaved(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    local = get_model_state_dict(model)
    names = whole_model_names(model, local)
    whole = {key: plain_name(names.get(key, key)) for key in local}
    known = whole_model_keys(model) or set(whole.values())
    if args.tie_embeddings:  # one parameter under two names: it is read as the embedding
        whole = {key: name for key, name in whole.items() if name != "output.weight"}
    wanted = {key: name for key, name in whole.items() if not name.startswith(exclude)}
    with ExitStack() as stack:
        weights = HFWeights(folder, stack)
        _check_keys(weights, set(wanted.values()), known, exclude)
        unit, batch = None, {}
        for key, name in wanted.items():
            if _unit(name) != unit and batch:
                set_model_state_dict(model, batch, options=StateDictOptions(strict=False))
                batch = {}
            unit = _unit(name)
            batch[key] = _read(weights, name, local[key], args, interleaved)
        if batch:
            set_model_state_dict(model, batch, options=StateDictOptions(strict=False))
        total = weights.total_bytes
    log.info(
        "warm start: weights from the Hugging Face folder %s (this rank read %.1f MB of the folder's %.1f MB)",
        folder,
        weights.bytes_read / 1e6,
        total / 1e6,
    )
    return weights.bytes_read
