"""The Llama family's Hugging Face format (forge.models.spec.HFAdapter): Llama, Qwen3, Mixtral, Qwen3-MoE and
DeepSeek-V3 folders. Names: forge.models.llama.hf_names; configs: forge.models.llama.hf_config.

Our stacked expert weights (experts, dim, hidden) are one transposed Linear per expert in the folder; DeepSeek-V3's
interleaved rotary rows are reordered on reading (a rank reads the whole rows of those, its columns only); a folder
with tied embeddings fills an untied head with a copy of the embedding.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from forge.checkpoint.errors import CheckpointError
from forge.models.llama.args import TransformerArgs
from forge.models.llama.hf_config import (
    FAMILIES,
    QWEN3_MOE,
    args_to_hf_config,
    family_of,
    hf_config_to_args,
    moe_unsupported,
    rope_interleaved,
    rope_row_order,
)
from forge.models.llama.hf_names import forge_to_hf_key, hf_expert, hf_to_forge_key

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer that old Llama exports saved; recomputed from rope_theta
_EMBEDDING = "model.embed_tokens.weight"


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
SOFT_FIELDS = ("rope_theta", "rope_scaling")
"""Config fields a warm start may change on purpose (a longer context): a warning, not a refusal."""


def _is_experts(key: str) -> bool:
    parts = key.split(".")
    return len(parts) == 5 and parts[2:4] == ["feed_forward", "experts"]


class LlamaHF:
    """forge.models.spec.HFAdapter of the Llama family."""

    model_types = tuple(FAMILIES)
    soft_fields = SOFT_FIELDS

    def config_to_args(self, config: dict) -> TransformerArgs:
        return hf_config_to_args(config)

    def args_to_config(self, args: TransformerArgs) -> dict:
        return args_to_hf_config(args)

    def check_config(self, theirs: TransformerArgs, args: TransformerArgs, config_file: Path) -> None:
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
                folder = config_file.parent
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

    def entries(self, key: str, shape: tuple[int, ...], args: TransformerArgs) -> list[tuple[str, tuple[int, ...]]]:
        """Stacked experts are one transposed matrix each."""
        family = family_of(args)
        if _is_experts(key):
            layer, name = key.split(".")[1], key.split(".")[4]
            return [(family.expert_key(layer, e, name), (shape[2], shape[1])) for e in range(shape[0])]
        return [(forge_to_hf_key(key, family), tuple(shape))]

    def to_hf(self, key: str, tensor: torch.Tensor, args: TransformerArgs) -> list[torch.Tensor]:
        return [w.T for w in tensor] if _is_experts(key) else [tensor]

    def read(self, key: str, shape: tuple[int, ...], box: tuple[slice, ...], weights, args: TransformerArgs):
        names = self._hf_names(key, args)
        order = rope_row_order(key, args) if rope_interleaved(weights.config) else None
        if order is not None:
            rows = weights.read(names, shape, (slice(0, shape[0]), *box[1:]))  # all rows: ours may come from any
            return rows[order][box[0]]
        if isinstance(names, str):
            if key == "output.weight" and names not in weights.files:
                names = _EMBEDDING  # tied in the folder, untied here: the head starts as a copy
            return weights.read(names, shape, box)
        experts, rows, cols = box
        pieces = [
            weights.read(names[e], (shape[2], shape[1]), (cols, rows)).T for e in range(*experts.indices(shape[0]))
        ]
        size = (experts.stop - experts.start, rows.stop - rows.start, cols.stop - cols.start)
        return torch.stack(pieces) if pieces else torch.empty(size)

    def our_keys(self, hf_names: set[str], args: TransformerArgs) -> set[str]:
        provided = set()
        for name in hf_names:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            expert = hf_expert(name)
            if expert:
                layer, _, stacked = expert
                provided.add(f"layers.{layer}.feed_forward.experts.{stacked}")
            else:
                provided.add(hf_to_forge_key(name))
        if _EMBEDDING in hf_names:
            provided.add("output.weight")  # a tied folder: see read
        return provided

    def _hf_names(self, key: str, args: TransformerArgs) -> str | list[str]:
        """The HF tensor our `key` reads (experts: one per expert, each the transpose of a slice)."""
        family, parts = family_of(args), key.split(".")
        if _is_experts(key):
            return [family.expert_key(parts[1], e, parts[4]) for e in range(args.moe.num_experts)]
        return forge_to_hf_key(key, family)
