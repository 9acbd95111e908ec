"""Hugging Face Llama <-> forge parameter names and configs (dense models).

Both sides use the rotate-half RoPE convention, so weights map one to one without permutation.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from forge.checkpoint.errors import CheckpointError
from forge.model.args import RopeScalingArgs, TransformerArgs

_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_forge_key(key: str) -> str:
    if key in _TOP_NAMES:
        return _TOP_NAMES[key]
    parts = key.split(".")
    if parts[:2] != ["model", "layers"]:
        raise CheckpointError(f"unexpected Hugging Face key '{key}'")
    layer, module, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
    if module not in _LAYER_NAMES:
        raise CheckpointError(f"unexpected Hugging Face key '{key}'")
    return f"layers.{layer}.{_LAYER_NAMES[module]}.{leaf}"


def forge_to_hf_key(key: str) -> str:
    reverse_top = {v: k for k, v in _TOP_NAMES.items()}
    if key in reverse_top:
        return reverse_top[key]
    reverse_layer = {v: k for k, v in _LAYER_NAMES.items()}
    parts = key.split(".")
    layer, module, leaf = parts[1], ".".join(parts[2:-1]), parts[-1]
    if parts[0] != "layers" or module not in reverse_layer:
        raise CheckpointError(f"key '{key}' has no Hugging Face Llama equivalent")
    return f"model.layers.{layer}.{reverse_layer[module]}.{leaf}"


def args_to_llama_config(args: TransformerArgs) -> dict:
    if args.moe is not None:
        raise CheckpointError("MoE models are not exported to Hugging Face yet (Mixtral export is open work)")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if args.qk_norm:
        raise CheckpointError("qk_norm has no LlamaForCausalLM equivalent; export is not supported")
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


def llama_config_to_args(config: dict) -> TransformerArgs:
    if config.get("model_type") not in ("llama", None):
        raise CheckpointError(f"model_type {config.get('model_type')!r} is not supported (llama only)")
    heads = config["num_attention_heads"]
    if config.get("head_dim", config["hidden_size"] // heads) * heads != config["hidden_size"]:
        raise CheckpointError("a head_dim other than hidden_size / num_attention_heads is not supported")
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or None
    rope_theta = config.get("rope_theta") or (scaling or {}).get("rope_theta", 10000.0)
    rope_scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        rope_scaling = RopeScalingArgs(
            factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_seq_len=scaling["original_max_position_embeddings"],
        )
    return TransformerArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads", heads),
        vocab_size=config["vocab_size"],
        ffn_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=config.get("tie_word_embeddings", False),
    )


def save_hf(state: dict[str, torch.Tensor], args: TransformerArgs, out_dir: Path) -> None:
    """Write config.json + model.safetensors loadable by LlamaForCausalLM.from_pretrained."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, value in state.items():
        if args.tie_embeddings and key == "output.weight":
            continue
        tensors[forge_to_hf_key(key)] = value.detach().to(torch.float32).contiguous().clone()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(args_to_llama_config(args), indent=2))


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], TransformerArgs]:
    """Read a Hugging Face Llama folder: (forge state dict, args)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    args = llama_config_to_args(json.loads(config_file.read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"cannot read {file}: {err}") from err
        state.update({hf_to_forge_key(k): v for k, v in tensors.items()})
    if args.tie_embeddings:
        state.pop("output.weight", None)
        state["output.weight"] = state["tok_embeddings.weight"]
    return state, args
