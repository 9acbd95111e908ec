"""The seam between a model family and the generic machinery.

A family is one package (forge.models.<name>, or a user's own): its module, its arguments, its parallel plan, its
cost, its Hugging Face adapter and its validation rules, gathered in the `SPEC` of the package's `spec` module. The
config names the family through the arguments class its `model._target_` builds; `spec_of` finds the spec beside
it. Nothing outside the family's folder names the family.

The generic machinery (FSDP, activation checkpointing, compile, the parallel initialisation, DCP, the loop) sees a
built model only through this module protocol:

- `layers`: an nn.ModuleDict of the blocks, each checkpointed, compiled and FSDP-wrapped on its own;
- `tok_embeddings`, `norm`, `output`: the token embedding, the final norm and the head (tied weights are re-tied
  by `tie_weights()` after allocation);
- `args`: the arguments it was built from;
- `forward(tokens, attn_mask=None, head=True)`: logits (batch, seq, vocab), or with head=False the final-norm hidden
  states that a chunked loss multiplies by `output.weight` itself; a family that decodes (`ModelSpec.generate`)
  also takes `cache` (forge.models.common.kv_cache.KVCache) and `positions` (batch, seq);
- context parallelism (`"cp"` in `ModelSpec.parallel`): each attention layer holds a `gather_kv` slot (None) that
  forge.parallel.context_parallel fills, passes it to forge.models.common.attention.visible_keys, and the model
  reads its tokens' positions from a DocumentMask's `queries`;
- `init_weights(seed)`, `init_specs()`, `init_buffers()`, `tie_weights()`: initialisation, identical whatever the
  layout (forge.models.common.init_spec, forge.parallel.init).
"""

import functools
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn


PARALLEL_DIMS = ("tp", "cp", "pp", "ep")
"""The parallel dimensions beyond data parallelism, which a family supports or not (ModelSpec.parallel)."""


@dataclass
class FlopsPerToken:
    """Forward FLOPs per token, by part of the model (matmuls only, 2 FLOPs per multiply-add)."""

    attention_projections: float
    """The attention's projections over all blocks."""
    attention_scores: float
    """QK^T and softmax(QK^T)V over all blocks; grows with seq_len."""
    mlp: float
    """The dense feed-forward layers."""
    moe: float
    """Router gates, routed and shared experts of MoE blocks (0 for a dense model)."""
    head: float
    """The output projection onto the vocabulary."""

    @property
    def forward(self) -> float:
        return self.attention_projections + self.attention_scores + self.mlp + self.moe + self.head

    @property
    def training(self) -> float:
        """Forward plus backward (twice the forward)."""
        return 3 * self.forward


class ModelCost(Protocol):
    """What metrics (MFU), `--plan` (memory per rank) and the layout search read of a model, from its arguments.
    Shapes shared by every family are read from the arguments themselves: dim, n_layers, vocab_size, max_seq_len,
    tie_embeddings."""

    def flops_per_token(self, args: Any, seq_len: int) -> FlopsPerToken:
        """Forward FLOPs per token on sequences of seq_len tokens."""
        ...

    def block_activation_elems(self, args: Any) -> float:
        """Elements per token that autograd keeps for one block's backward (before tensor parallelism divides
        them; forge.planning.memory's formula adds norms' upcasts and the head)."""
        ...

    def block_unsplit_bytes(self, args: Any, act_bytes: int) -> float:
        """Bytes per token that autograd keeps for one block (averaged over the blocks) whole on every tensor-parallel
        rank, beyond the all-gathered inputs of its matmuls (an MoE layer's routing of the gathered sequence)."""
        ...

    def saved_kv_width(self, args: Any) -> float:
        """Elements per token of one layer's keys and values as attention keeps them (context parallelism gathers
        them from every cp rank)."""
        ...

    def kv_width(self, args: Any) -> float:
        """Elements per token of one layer's keys plus values as attention reads them (context parallelism
        all-gathers them)."""
        ...

    def block_gather_params(self, args: Any, degrees: Any) -> float:
        """Parameters of the largest block that FSDP all-gathers at once."""
        ...

    def block_norm_elems(self, args: Any) -> float:
        """Elements of one block's norm weights (under tensor parallelism their gradients are all-reduced)."""
        ...

    def host_tables_elems(self, args: Any) -> float:
        """Elements of the tables the model computes on the host at initialisation (rotary tables; 0 if none)."""
        ...


class HFAdapter(Protocol):
    """A family's Hugging Face format: its config.json and its tensor names, read and written one tensor (or one
    rank's box of one) at a time, so no rank holds a whole state dict (forge.checkpoint.hf_load, hf_save)."""

    model_types: tuple[str, ...]
    """config.json `model_type`s this adapter reads."""

    def config_to_args(self, config: dict) -> Any:
        """The model arguments of a config.json (CheckpointError for what the family cannot build)."""
        ...

    def args_to_config(self, args: Any) -> dict:
        """config.json of a model (CheckpointError, before anything is written, for what the format cannot say)."""
        ...

    def check_config(self, theirs: Any, args: Any, config_file: Any) -> None:
        """The arguments `theirs` read from `config_file` describe the model of `args`: CheckpointError naming the
        first field that differs."""
        ...

    def entries(self, key: str, shape: tuple[int, ...], args: Any) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of the tensors our parameter `key` (whole shape `shape`) is written as."""
        ...

    def to_hf(self, key: str, tensor: Any, args: Any) -> list[Any]:
        """The tensors of `entries`, in order, from our whole tensor."""
        ...

    def read(self, key: str, shape: tuple[int, ...], box: tuple[slice, ...], weights: Any, args: Any) -> Any:
        """Our tensor `key`'s box (slices of its whole `shape`), from the folder's `weights`
        (forge.checkpoint.hf.HFWeights: `weights.read(hf_name, hf_shape, hf_box)` returns that box of an HF tensor;
        `weights.files` names them, `weights.config` is the folder's config.json)."""
        ...

    def our_keys(self, hf_names: set[str], args: Any) -> set[str]:
        """Our parameter keys that the folder's tensors `hf_names` provide (unknown names raise CheckpointError)."""
        ...


@dataclass(frozen=True)
class ModelSpec:
    """Everything the generic machinery needs of one family (see the module docstring)."""

    name: str
    """The family's name, as logs and errors say it."""
    args: type
    """The arguments dataclass (the schema of conf/model presets that build this family)."""
    build: Callable[[Any], "nn.Module"]
    """A model from its arguments (called under torch.device('meta') by the runner)."""
    check: Callable[[Any, Any], None]
    """Rules between the model's fields and the other groups: (cfg, degrees) -> None, raising ConfigError."""
    tensor_parallel: Callable[["nn.Module", Any], Any] | None
    """(model, tp mesh) -> Applied: the family's TP plan; None when it has none (parallel.tp > 1 refused)."""
    cost: ModelCost
    hf: HFAdapter | None = None
    """The Hugging Face format; None when the family has none (warm starts and exports refused)."""
    parallel: frozenset[str] = frozenset()
    """The parallel dimensions beyond data parallelism (fsdp, hsdp, ddp: every family) the model supports, of
    tp, cp, pp, ep; the others are refused in one line and the layout search leaves them out. pp: the generic
    stage split (forge.parallel.pipeline) holds for the model; cp: its attention runs the context-parallel
    gather (forge.parallel.context_parallel)."""
    generate: bool = False
    """Whether the model decodes with a KV cache (forge-generate)."""
    aliases: tuple[str, ...] = ()
    """Former import paths of the arguments class, which configs saved in older checkpoints name."""

    @property
    def target(self) -> str:
        """The `_target_` of the arguments class (what conf/model presets of the family set)."""
        return f"{self.args.__module__}.{self.args.__qualname__}"


@functools.cache
def families() -> tuple[ModelSpec, ...]:
    """The spec of every model family under forge.models (a package with a `spec` module); importing them runs
    only forge's own code."""
    specs = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.ispkg and importlib.util.find_spec(f"forge.models.{info.name}.spec") is not None:
            specs.append(importlib.import_module(f"forge.models.{info.name}.spec").SPEC)
    return tuple(specs)


def known_spec(target: str) -> ModelSpec | None:
    """The family under forge.models whose arguments class is `target` (or was: an alias), else None. For
    untrusted files (a checkpoint's config): nothing is imported from the name itself."""
    for spec in families():
        if target == spec.target or target in spec.aliases:
            return spec
    return None


def spec_module(target: str) -> str:
    """The spec module of an arguments class path: `pkg.family.args.Args` -> `pkg.family.spec`."""
    module = target.rsplit(".", 1)[0]
    return module.rsplit(".", 1)[0] + ".spec"


def spec_of(model: Any) -> ModelSpec:
    """The spec of a model config node (its `_target_`), an arguments instance or a built model (its `args`)."""
    if hasattr(model, "args") and not isinstance(model, Mapping):  # a built model (imported without torch here)
        model = model.args
    if isinstance(model, Mapping):
        target = model["_target_"]
    else:
        target = f"{type(model).__module__}.{type(model).__qualname__}"
    return importlib.import_module(spec_module(target)).SPEC
