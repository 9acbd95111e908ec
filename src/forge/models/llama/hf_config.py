"""Hugging Face config.json <-> forge model args, for the five transformers architectures forge's decoder is.

Which one a model is follows from three settings: a latent-attention model (`model.attention_kind=mla`) is
`DeepseekV3ForCausalLM` (dense, or MoE after its first dense blocks, group-limited and scaled as
model.moe says); an MoE model is
`MixtralForCausalLM` or, with per-head q/k norms (`model.qk_norm=true`), `Qwen3MoeForCausalLM`; a dense one is
`LlamaForCausalLM` or, with q/k norms, `Qwen3ForCausalLM`. DeepSeek-V3 checkpoints interleave the rotary pairs
(`rope_interleave`, default true); forge rotates halves, so those rows are reordered on import (`rope_row_order`)
and exports say rope_interleave=false.
The other four use rotate-half RoPE, SwiGLU and RMSNorm (the q/k norms too: over head_dim, before RoPE, with the
model's eps), bias-free projections and an explicit `head_dim`. Their MoE routers are softmax
top-k; Qwen3-MoE renormalises the k weights only under `norm_topk_prob` (forge always does). Settings one side
cannot express are refused with a CheckpointError naming them, never dropped.
"""

from dataclasses import dataclass, field

import torch

from forge.checkpoint.errors import CheckpointError
from forge.models.llama.args import MLAArgs, MoEArgs, RopeScalingArgs, TransformerArgs


@dataclass(frozen=True)
class HFFamily:
    """One transformers architecture, and where its MoE blocks keep their router and experts."""

    architecture: str
    model_type: str
    moe_module: str = ""
    """Module of an MoE block's `gate` and `experts` (block_sparse_moe in Mixtral, mlp in Qwen3-MoE)."""
    expert_names: dict[str, str] = field(default_factory=dict)
    """Our stacked expert weight -> the name of each expert's Linear."""

    def expert_key(self, layer: str | int, expert: int, name: str) -> str:
        return f"model.layers.{layer}.{self.moe_module}.experts.{expert}.{self.expert_names[name]}.weight"


LLAMA = HFFamily("LlamaForCausalLM", "llama")
QWEN3 = HFFamily("Qwen3ForCausalLM", "qwen3")
MIXTRAL = HFFamily("MixtralForCausalLM", "mixtral", "block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"})
QWEN3_MOE = HFFamily("Qwen3MoeForCausalLM", "qwen3_moe", "mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
DEEPSEEK_V3 = HFFamily(
    "DeepseekV3ForCausalLM", "deepseek_v3", "mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
)
FAMILIES = {f.model_type: f for f in (LLAMA, QWEN3, MIXTRAL, QWEN3_MOE, DEEPSEEK_V3)}


def family_of(args: TransformerArgs) -> HFFamily:
    if getattr(args, "attention_kind", "gqa") == "mla":
        return DEEPSEEK_V3
    if args.moe is not None:
        return QWEN3_MOE if args.qk_norm else MIXTRAL
    return QWEN3 if args.qk_norm else LLAMA


def moe_unsupported(moe: MoEArgs, family: HFFamily = MIXTRAL) -> str | None:
    """The first MoE setting `family` cannot express, as `model.moe.X=value (why)`; None if all fit."""
    name = "Mixtral" if family is MIXTRAL else "DeepSeek-V3" if family is DEEPSEEK_V3 else "Qwen3-MoE"
    router = "sigmoid_topk" if family is DEEPSEEK_V3 else "softmax_topk"
    if moe.router != router:
        return f"model.moe.router={moe.router} ({name} routes with {router})"
    if moe.num_shared_experts and family is not DEEPSEEK_V3:
        return f"model.moe.num_shared_experts={moe.num_shared_experts} ({name} has no shared experts)"
    if moe.every != 1 and family in (MIXTRAL, DEEPSEEK_V3):
        what = "every Mixtral block is" if family is MIXTRAL else "every block from first_k_dense_replace on is"
        return f"model.moe.every={moe.every} ({what} an MoE block)"
    if family is not DEEPSEEK_V3:
        if moe.first_dense:
            return f"model.moe.first_dense={moe.first_dense} ({name} places dense blocks by no leading count)"
        if moe.groups_per_token < moe.expert_groups:
            return f"model.moe.expert_groups={moe.expert_groups} ({name} has no group-limited routing)"
        if moe.route_scale != 1.0:
            return f"model.moe.route_scale={moe.route_scale} ({name} does not scale its combine weights)"
    if moe.capacity_factor > 0:
        return f"model.moe.capacity_factor={moe.capacity_factor} ({name} drops no tokens)"
    return None


def args_to_hf_config(args: TransformerArgs) -> dict:
    """config.json of the transformers model (see the module docstring for which) equal to a model of `args`."""
    family = family_of(args)
    window = getattr(args, "sliding_window", None)
    if window is not None:
        raise CheckpointError(f"model.sliding_window={window} has no {family.architecture} equivalent (full attention)")
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if family is LLAMA:
        config |= {"attention_bias": False, "mlp_bias": False}
    if family in (QWEN3, QWEN3_MOE):
        config |= {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    if family is DEEPSEEK_V3:
        config |= _deepseek_v3_config(args)
    if args.moe is not None:
        reason = moe_unsupported(args.moe, family)
        if reason:
            raise CheckpointError(
                f"{reason} has no {family.architecture} equivalent; this MoE model cannot be exported to Hugging Face"
            )
    if family is MIXTRAL:
        config |= {
            "intermediate_size": args.moe.expert_ffn_dim or args.hidden_dim,
            "num_local_experts": args.moe.num_experts,
            "num_experts_per_tok": args.moe.top_k,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    elif family is QWEN3_MOE:
        config |= {
            "moe_intermediate_size": args.moe.expert_ffn_dim or args.hidden_dim,
            "num_experts": args.moe.num_experts,
            "num_experts_per_tok": args.moe.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": args.moe.every,
            "mlp_only_layers": [],
        }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    return config


def _deepseek_v3_config(args: TransformerArgs) -> dict:
    """The DeepSeek-V3 fields of a latent-attention model: dense, or MoE from block model.moe.first_dense on
    (first_k_dense_replace), routed by forge's sigmoid_topk router (renormalised unbiased scores times
    route_scale, the bias only choosing, within the best groups_per_token of expert_groups)."""
    moe_fields: dict = {"first_k_dense_replace": args.n_layers}
    if args.moe is not None:
        reason = moe_unsupported(args.moe, DEEPSEEK_V3)
        if reason:
            raise CheckpointError(f"{reason} has no DeepseekV3ForCausalLM equivalent; this model cannot be exported")
        moe_fields = {
            "first_k_dense_replace": args.moe.first_dense,
            "n_routed_experts": args.moe.num_experts,
            "num_experts_per_tok": args.moe.top_k,
            "moe_intermediate_size": args.moe.expert_ffn_dim or args.hidden_dim,
            "n_shared_experts": args.moe.num_shared_experts,
            "n_group": args.moe.expert_groups,
            "topk_group": args.moe.groups_per_token,
            "routed_scaling_factor": args.moe.route_scale,
            "norm_topk_prob": True,
        }
    if args.qk_norm:
        raise CheckpointError("model.qk_norm=true has no DeepseekV3ForCausalLM equivalent")
    m = args.mla
    return {
        "head_dim": m.qk_rope_head_dim,  # what transformers sets for DeepSeek-V3 (its rotary width)
        "num_key_value_heads": args.n_heads,
        "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_interleave": False,
        "attention_bias": False,
        **moe_fields,
    }


def _deepseek_v3_moe(config: dict) -> MoEArgs | None:
    """None for a dense model; MoE from block first_k_dense_replace on as forge's sigmoid_topk router, or a
    CheckpointError naming the first routing setting forge cannot express."""
    layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 3)
    if dense >= layers:
        return None
    groups, kept = config.get("n_group", 8) or 1, config.get("topk_group", 4) or 1  # transformers' defaults
    if not config.get("norm_topk_prob", True):
        raise CheckpointError("norm_topk_prob=false is not supported (forge's sigmoid_topk renormalises the k weights)")
    return MoEArgs(
        num_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        num_shared_experts=config.get("n_shared_experts") or 0,
        expert_ffn_dim=config["moe_intermediate_size"],
        first_dense=dense,
        expert_groups=groups,
        groups_per_token=min(kept, groups),
        route_scale=float(config.get("routed_scaling_factor", 2.5)),
        router="sigmoid_topk",
    )


def _deepseek_v3_mla(config: dict) -> MLAArgs:
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) != heads:
        raise CheckpointError(f"num_key_value_heads={config['num_key_value_heads']} != num_attention_heads={heads}")
    return MLAArgs(
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
    )


def rope_interleaved(config: dict) -> bool:
    """The checkpoint's rotary pairs are interleaved (DeepSeek-V3's rope_interleave, true unless said)."""
    return config.get("model_type") == DEEPSEEK_V3.model_type and config.get("rope_interleave", True) is not False


def rope_row_order(key: str, args: TransformerArgs) -> torch.Tensor | None:
    """For a weight whose output rows carry rotary dimensions (MLA's wq / wq_b per head, wkv_a's shared key), the
    order of a checkpoint's interleaved rows that makes them forge's rotate-half layout; None for the others."""
    if getattr(args, "attention_kind", "gqa") != "mla":
        return None
    m = args.mla
    pairs = torch.cat([torch.arange(0, m.qk_rope_head_dim, 2), torch.arange(1, m.qk_rope_head_dim, 2)])
    if key.endswith(("attention.wq.weight", "attention.wq_b.weight")):
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        head = torch.cat([torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + pairs])
        return torch.cat([h * qk + head for h in range(args.n_heads)])
    if key.endswith("attention.wkv_a.weight"):
        return torch.cat([torch.arange(m.kv_lora_rank), m.kv_lora_rank + pairs])
    return None


def _rope(config: dict) -> tuple[float, RopeScalingArgs | None]:
    """(rope_theta, Llama-3 scaling) from a config's rope_scaling / rope_parameters (transformers 5 writes the
    latter, with rope_theta inside)."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or None
    rope_theta = config.get("rope_theta") or (scaling or {}).get("rope_theta", 10000.0)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        return rope_theta, RopeScalingArgs(
            factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_seq_len=scaling["original_max_position_embeddings"],
        )
    if kind != "default":  # linear, dynamic, yarn, ...: positions would silently differ
        raise CheckpointError(f"rope_type {kind!r} is not supported (default and llama3 only)")
    return rope_theta, None


def _qwen3_moe_args(config: dict) -> MoEArgs:
    if config.get("mlp_only_layers"):
        raise CheckpointError(
            f"mlp_only_layers={config['mlp_only_layers']} is not supported (forge places dense blocks by "
            "decoder_sparse_step only: model.moe.every)"
        )
    if not config.get("norm_topk_prob", False):
        raise CheckpointError(
            "norm_topk_prob=false is not supported (forge's softmax_topk router renormalises the k weights)"
        )
    return MoEArgs(
        num_experts=config["num_experts"] if "num_experts" in config else config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        expert_ffn_dim=config["moe_intermediate_size"],
        every=config.get("decoder_sparse_step", 1),
        router="softmax_topk",
    )


def hf_config_to_args(config: dict) -> TransformerArgs:
    """Our model args from a Llama, Mixtral, Qwen3, Qwen3-MoE or DeepSeek-V3 config.json."""
    model_type = config.get("model_type") or LLAMA.model_type
    if model_type not in FAMILIES:
        raise CheckpointError(f"model_type {model_type!r} is not supported ({', '.join(FAMILIES)} only)")
    family = FAMILIES[model_type]
    qwen = family in (QWEN3, QWEN3_MOE)
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise CheckpointError(f"{flag}=true is not supported (forge's projections have no bias)")
    sliding = config.get("use_sliding_window" if qwen else "sliding_window")
    if sliding or "sliding_attention" in (config.get("layer_types") or []):
        raise CheckpointError(f"sliding_window={config.get('sliding_window')} is not supported (full attention only)")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim")
    if head_dim and head_dim * heads == hidden:
        head_dim = None  # the width follows from dim / n_heads, as in every Llama preset
    rope_theta, rope_scaling = _rope(config)
    moe = None
    if family is MIXTRAL:
        moe = MoEArgs(
            num_experts=config["num_local_experts"],
            top_k=config["num_experts_per_tok"],
            expert_ffn_dim=config["intermediate_size"],
            router="softmax_topk",
        )
    elif family is QWEN3_MOE:
        moe = _qwen3_moe_args(config)
    if family is DEEPSEEK_V3:
        return TransformerArgs(
            dim=hidden,
            n_layers=config["num_hidden_layers"],
            n_heads=heads,
            vocab_size=config["vocab_size"],
            ffn_dim=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=config.get("max_position_embeddings", 2048),
            tie_embeddings=config.get("tie_word_embeddings", False),
            attention_kind="mla",
            mla=_deepseek_v3_mla(config),
            moe=_deepseek_v3_moe(config),
        )
    return TransformerArgs(
        dim=hidden,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=head_dim,
        vocab_size=config["vocab_size"],
        ffn_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6 if qwen else 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=config.get("max_position_embeddings", 2048),
        qk_norm=qwen,
        tie_embeddings=config.get("tie_word_embeddings", False),
        moe=moe,
    )
