"""Hugging Face <-> forge parameter names of the Llama family (configs: hf_config; the adapter: hf).

All four architectures (Llama, Qwen3, Mixtral, Qwen3-MoE; which one a model is: forge.models.llama.hf_config) use
the rotate-half RoPE convention, so attention weights map one to one without permutation, and share the dense
names (Qwen3's q_norm / k_norm are ours). MoE blocks are in the Hub's layout, which transformers also writes and
reads: one Linear per expert, under `block_sparse_moe` with w1/w2/w3 (Mixtral) or under `mlp` with
gate_proj/down_proj/up_proj (Qwen3-MoE, whose dense blocks keep the `mlp.*_proj` names). Ours stacks the experts as
(experts, dim, hidden) and (experts, hidden, dim) matrices applied as x @ w, so each expert's Linear weight is the
transpose of its slice.
"""

import re

from forge.checkpoint.errors import CheckpointError
from forge.models.llama.hf_config import (
    HFFamily,
)

_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "self_attn.q_a_proj": "attention.wq_a",  # DeepSeek-V3's latent attention
    "self_attn.q_a_layernorm": "attention.q_a_norm",
    "self_attn.q_b_proj": "attention.wq_b",
    "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
    "self_attn.kv_a_layernorm": "attention.kv_a_norm",
    "self_attn.kv_b_proj": "attention.wkv_b",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.shared_experts.gate_proj": "feed_forward.shared_experts.w1",  # DeepSeek-V3's shared experts
    "mlp.shared_experts.up_proj": "feed_forward.shared_experts.w3",
    "mlp.shared_experts.down_proj": "feed_forward.shared_experts.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_ROUTER = "feed_forward.router.gate"
_HF_ROUTERS = ("block_sparse_moe.gate", "mlp.gate")  # Mixtral's, Qwen3-MoE's and DeepSeek-V3's
_ROUTER_BIAS = ("e_score_correction_bias", "feed_forward.router.expert_bias")  # DeepSeek-V3's gate leaf, ours
_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_NAMES = {"w1": "w1", "w2": "w2", "w3": "w3", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_FORGE_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")


def hf_expert(key: str) -> tuple[str, int, str] | None:
    """(layer, expert id, our stacked weight w1/w2/w3) of one expert's Linear in either MoE layout, else None."""
    match = _HF_EXPERT.match(key)
    if match is None:
        return None
    layer, expert, name = match.groups()
    return layer, int(expert), _EXPERT_NAMES[name]


def forge_experts(key: str) -> tuple[str, str] | None:
    """(layer, w1/w2/w3) of our stacked expert weight `key`, else None."""
    match = _FORGE_EXPERTS.match(key)
    return None if match is None else (match.group(1), match.group(2))


def hf_to_forge_key(key: str) -> str:
    if key in _TOP_NAMES:
        return _TOP_NAMES[key]
    parts = key.split(".")
    if parts[:2] != ["model", "layers"]:
        raise CheckpointError(f"unexpected Hugging Face key '{key}'")
    layer, module, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
    if module in _HF_ROUTERS:
        if leaf == _ROUTER_BIAS[0]:  # the sigmoid router's selection bias
            return f"layers.{layer}.{_ROUTER_BIAS[1]}"
        return f"layers.{layer}.{_ROUTER}.{leaf}"
    if module not in _LAYER_NAMES:
        raise CheckpointError(f"unexpected Hugging Face key '{key}'")
    return f"layers.{layer}.{_LAYER_NAMES[module]}.{leaf}"


def forge_to_hf_key(key: str, family: HFFamily) -> str:
    """The name of our (non-expert) `key` in `family`'s checkpoints."""
    reverse_top = {v: k for k, v in _TOP_NAMES.items()}
    if key in reverse_top:
        return reverse_top[key]
    reverse_layer = {v: k for k, v in _LAYER_NAMES.items()}
    if family.moe_module:
        reverse_layer[_ROUTER] = f"{family.moe_module}.gate"
    parts = key.split(".")
    layer, module, leaf = parts[1], ".".join(parts[2:-1]), parts[-1]
    if family.moe_module and ".".join(parts[2:]) == _ROUTER_BIAS[1]:
        return f"model.layers.{layer}.{family.moe_module}.gate.{_ROUTER_BIAS[0]}"
    if parts[0] != "layers" or module not in reverse_layer:
        raise CheckpointError(f"key '{key}' has no Hugging Face {family.architecture} equivalent")
    return f"model.layers.{layer}.{reverse_layer[module]}.{leaf}"
