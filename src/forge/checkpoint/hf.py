"""Hugging Face <-> forge parameter names and state dicts, and whole-folder save/load (configs: hf_config).

All four architectures (Llama, Qwen3, Mixtral, Qwen3-MoE; which one a model is: forge.checkpoint.hf_config) use
the rotate-half RoPE convention, so attention weights map one to one without permutation, and share the dense
names (Qwen3's q_norm / k_norm are ours). MoE blocks are in the Hub's layout, which transformers also writes and
reads: one Linear per expert, under `block_sparse_moe` with w1/w2/w3 (Mixtral) or under `mlp` with
gate_proj/down_proj/up_proj (Qwen3-MoE, whose dense blocks keep the `mlp.*_proj` names). Ours stacks the experts as
(experts, dim, hidden) and (experts, hidden, dim) matrices applied as x @ w, so each expert's Linear weight is the
transpose of its slice.
"""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.hf_config import (
    HFFamily,
    args_to_hf_config,
    family_of,
    read_hf_config,
    rope_interleaved,
    rope_row_order,
)
from forge.models.llama.args import TransformerArgs

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


def forge_to_hf_state(state: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict as Hugging Face tensors (fp32, contiguous); stacked experts become one Linear each."""
    family = family_of(args)
    tensors = {}
    for key, value in state.items():
        if args.tie_embeddings and key == "output.weight":
            continue
        value = value.detach().to(torch.float32)
        stacked = forge_experts(key)
        if stacked:
            layer, name = stacked
            for expert, weight in enumerate(value):
                tensors[family.expert_key(layer, expert, name)] = weight.T.contiguous()
        else:
            tensors[forge_to_hf_key(key, family)] = value.contiguous().clone()
    return tensors


def hf_to_forge_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors as our state dict; per-expert Linears are stacked back."""
    state, experts = {}, {}
    for key, value in tensors.items():
        expert = hf_expert(key)
        if expert:
            layer, expert_id, name = expert
            experts.setdefault((layer, name), {})[expert_id] = value
        else:
            state[hf_to_forge_key(key)] = value
    for (layer, name), by_id in experts.items():
        if sorted(by_id) != list(range(len(by_id))):
            raise CheckpointError(f"layer {layer} {name}: expert ids {sorted(by_id)} are not 0..{len(by_id) - 1}")
        state[f"layers.{layer}.feed_forward.experts.{name}"] = torch.stack([by_id[e].T for e in sorted(by_id)])
    return state


def save_hf(state: dict[str, torch.Tensor], args: TransformerArgs, out_dir: Path) -> None:
    """Write config.json + model.safetensors that transformers' from_pretrained loads (Llama, Qwen3, Mixtral or
    Qwen3-MoE, see forge.checkpoint.hf_config)."""
    config = args_to_hf_config(args)  # before writing anything: an unsupported model leaves no folder behind
    tensors = forge_to_hf_state(state, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], TransformerArgs]:
    """Read a Hugging Face Llama, Qwen3, Mixtral or Qwen3-MoE folder: (forge state dict, args)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    args = read_hf_config(config_file)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"cannot read {file}: {err}") from err
    state = hf_to_forge_state(tensors)
    if rope_interleaved(json.loads(config_file.read_text(encoding="utf-8"))):
        for key, value in state.items():
            order = rope_row_order(key, args)
            if order is not None:
                state[key] = value[order]
    if args.tie_embeddings:
        state.pop("output.weight", None)
        state["output.weight"] = state["tok_embeddings.weight"]
    return state, args
