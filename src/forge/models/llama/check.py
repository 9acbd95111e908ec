"""The Llama family's rules between its fields and the other groups (forge.models.spec.ModelSpec.check); each
field's own range is its domain (forge.config.domains)."""

from omegaconf import DictConfig, OmegaConf

from forge.config.degrees import Degrees
from forge.config.errors import ConfigError, require
from forge.domain import INT64_MAX
from forge.models.llama.args import TransformerArgs


def check(cfg: DictConfig, degrees: Degrees) -> None:
    """Every rule of the family, raising ConfigError naming the keys."""
    model = cfg.model
    validate_model(model)
    kv = model.n_kv_heads or model.n_heads
    require(
        model.n_heads % degrees.tp == 0 and kv % degrees.tp == 0,
        f"model.n_heads={model.n_heads} and model.n_kv_heads={kv} must be divisible by parallel.tp={degrees.tp}",
    )
    if model.get("moe") is not None and degrees.tp > 1:
        validate_moe_tensor_parallel(model, degrees.tp)


def validate_model(model: DictConfig) -> None:
    """Rules between the model's fields (each field's own range is its domain, forge.config.domains)."""
    dim, heads, kv = model.dim, model.n_heads, model.n_kv_heads or model.n_heads
    head_dim = model.get("head_dim")
    if head_dim is None:
        require(dim % heads == 0, f"model.dim={dim} is not divisible by model.n_heads={heads}")
        require((dim // heads) % 2 == 0, f"model.dim / model.n_heads = {dim // heads} must be even for RoPE")
    else:
        require(head_dim % 2 == 0, f"model.head_dim={head_dim} must be even for RoPE")
    require(heads % kv == 0, f"model.n_heads={heads} is not divisible by model.n_kv_heads={kv}")
    scaling = model.get("rope_scaling")
    if scaling is not None:
        require(
            scaling.low_freq_factor < scaling.high_freq_factor,
            f"model.rope_scaling.low_freq_factor={scaling.low_freq_factor} must be below "
            f"model.rope_scaling.high_freq_factor={scaling.high_freq_factor} (the band between them is blended)",
        )
    validate_mla(model)
    validate_tensor_sizes(model)
    moe = model.get("moe")
    if moe is not None:
        require(
            moe.top_k <= moe.num_experts,
            f"model.moe.top_k={moe.top_k} must be in 1..model.moe.num_experts={moe.num_experts}",
        )
        require(
            moe.first_dense < model.n_layers,
            f"model.moe.first_dense={moe.first_dense} must be in 0..model.n_layers - 1 ({model.n_layers - 1})",
        )
        groups, kept = moe.expert_groups, moe.groups_per_token
        require(
            moe.num_experts % groups == 0,
            f"model.moe.expert_groups={groups} must divide model.moe.num_experts={moe.num_experts}",
        )
        require(kept <= groups, f"model.moe.groups_per_token={kept} must be in 1..model.moe.expert_groups={groups}")
        if groups > 1:
            require(
                kept == groups or not moe.balanced_selection,
                f"model.moe.balanced_selection with model.moe.expert_groups={groups} and groups_per_token={kept} is "
                "not supported: the offsets balance experts, not the groups a token keeps",
            )
            per_group = moe.num_experts // groups
            require(per_group >= 2, f"model.moe.expert_groups={groups} leaves fewer than 2 experts per group")
            require(
                moe.top_k <= kept * per_group,
                f"model.moe.top_k={moe.top_k} is more than the {kept * per_group} experts of "
                f"model.moe.groups_per_token={kept} groups",
            )


def plain_args(model: DictConfig) -> TransformerArgs:
    """The model's arguments as the dataclass the model is built from (its derived widths: hidden_dim, head_size);
    widths that cannot be derived (an overflowing multiplier) or come out empty are refused."""
    args = TransformerArgs(**{k: v for k, v in OmegaConf.to_container(model, resolve=True).items() if k[0] != "_"})
    try:
        hidden = args.hidden_dim
    except (OverflowError, ValueError) as err:
        message = f"model.ffn_dim_multiplier={model.ffn_dim_multiplier} gives no feed-forward width ({err})"
        raise ConfigError(message) from None
    require(
        hidden >= 1,
        f"model.ffn_dim_multiplier={model.ffn_dim_multiplier} makes the feed-forward width {hidden} (it must be at "
        "least 1; set model.ffn_dim)",
    )
    return args


def largest_tensors(model: DictConfig) -> dict[str, int]:
    """The elements of the model's largest weights and its rotary table, from its widths alone (no tensor is made):
    {what: elements}."""
    args = plain_args(model)
    sizes = {
        "the embedding (model.vocab_size x model.dim)": args.vocab_size * args.dim,
        "a feed-forward weight (model.dim x its hidden size)": args.dim * args.hidden_dim,
        "an attention projection (model.dim x the heads x their width)": args.dim * args.n_heads * args.head_size,
        "the rotary table (model.max_seq_len x the rotary width)": args.max_seq_len * args.rope_dim,
    }
    if args.moe is not None:
        expert = args.moe.expert_ffn_dim or args.hidden_dim
        sizes["an expert weight (model.moe.num_experts x model.dim x its hidden size)"] = (
            args.moe.num_experts * args.dim * expert
        )
    return sizes


def validate_tensor_sizes(model: DictConfig) -> None:
    """A weight too large for a tensor's byte count (an int64) would fail deep in torch ("Storage size calculation
    overflowed"), even on the meta device: refused by its widths. Whether the model fits the device is the run's
    check (forge.train.fits_device), not --plan's."""
    for what, elements in largest_tensors(model).items():
        require(
            4 * elements <= INT64_MAX,
            f"{what} would hold {elements:.3g} elements, more than a tensor's byte count can hold (2^63 bytes in "
            f"fp32): make the model smaller (model.dim={model.dim}, model.vocab_size={model.vocab_size})",
        )


def validate_mla(model: DictConfig) -> None:
    """model.attention_kind, and under mla the latent widths. A preset's n_kv_heads and head_dim do not apply to
    latent attention (its widths are model.mla's) and are left as they are; q/k norms are refused."""
    kind = model.get("attention_kind", "gqa")
    if kind != "mla":
        return
    mla = model.mla
    require(mla.qk_rope_head_dim % 2 == 0, f"model.mla.qk_rope_head_dim={mla.qk_rope_head_dim} must be even for RoPE")
    require(
        not model.qk_norm,
        "model.qk_norm=true is not supported with model.attention_kind=mla (latent attention norms its latents)",
    )


def validate_moe_tensor_parallel(model: DictConfig, tp: int) -> None:
    """Under tensor parallelism each expert's hidden width is split over the tp ranks (forge.parallel
    .expert_tensor): it must split evenly (a part the grouped GEMMs' strides do not fit runs one expert at a time)."""
    args = plain_args(model)
    width = args.moe.expert_ffn_dim or args.hidden_dim
    require(
        width % tp == 0,
        f"the experts' hidden width {width} (model.moe.expert_ffn_dim, or the dense one) is not divisible by "
        f"parallel.tp={tp}: each tp rank holds an equal part of it",
    )
