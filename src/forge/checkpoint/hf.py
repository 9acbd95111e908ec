"""Hugging Face Llama and Mixtral <-> forge parameter names and configs.

Both sides use the rotate-half RoPE convention, so attention weights map one to one without permutation.
Dense models are `LlamaForCausalLM`. MoE models are `MixtralForCausalLM` in the Hub's layout, which transformers
also writes and reads: one w1/w2/w3 Linear per expert under `block_sparse_moe`. Ours stacks the experts as
(experts, dim, hidden) and (experts, hidden, dim) matrices applied as x @ w, so each expert's Linear weight is the
transpose of its slice. Mixtral expresses only some MoE settings (every block MoE, softmax top-k router with the k
weights renormalised, no shared experts, no capacity limit); `mixtral_unsupported` names the first one outside them.
"""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from forge.checkpoint.errors import CheckpointError
from forge.model.args import MoEArgs, RopeScalingArgs, TransformerArgs

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
    "block_sparse_moe.gate": "feed_forward.router.gate",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_FORGE_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")


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
        raise CheckpointError(f"key '{key}' has no Hugging Face Llama or Mixtral equivalent")
    return f"model.layers.{layer}.{reverse_layer[module]}.{leaf}"


def forge_to_hf_state(state: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Our state dict as Hugging Face tensors (fp32, contiguous); stacked experts become one Linear each."""
    tensors = {}
    for key, value in state.items():
        if args.tie_embeddings and key == "output.weight":
            continue
        value = value.detach().to(torch.float32)
        stacked = _FORGE_EXPERTS.match(key)
        if stacked:
            layer, name = stacked.groups()
            for expert, weight in enumerate(value):
                hf_key = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}.weight"
                tensors[hf_key] = weight.T.contiguous()
        else:
            tensors[forge_to_hf_key(key)] = value.contiguous().clone()
    return tensors


def hf_to_forge_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors as our state dict; Mixtral's per-expert Linears are stacked back."""
    state, experts = {}, {}
    for key, value in tensors.items():
        match = _HF_EXPERT.match(key)
        if match:
            layer, expert, name = match.groups()
            experts.setdefault((layer, name), {})[int(expert)] = value
        else:
            state[hf_to_forge_key(key)] = value
    for (layer, name), by_id in experts.items():
        if sorted(by_id) != list(range(len(by_id))):
            raise CheckpointError(f"layer {layer} {name}: expert ids {sorted(by_id)} are not 0..{len(by_id) - 1}")
        state[f"layers.{layer}.feed_forward.experts.{name}"] = torch.stack([by_id[e].T for e in sorted(by_id)])
    return state


def mixtral_unsupported(moe: MoEArgs) -> str | None:
    """The first MoE setting MixtralForCausalLM cannot express, as `model.moe.X=value (why)`; None if all fit."""
    if moe.router != "softmax_topk":
        return f"model.moe.router={moe.router} (Mixtral routes with softmax_topk)"
    if moe.num_shared_experts:
        return f"model.moe.num_shared_experts={moe.num_shared_experts} (Mixtral has no shared experts)"
    if moe.every != 1:
        return f"model.moe.every={moe.every} (every Mixtral block is an MoE block)"
    if moe.capacity_factor > 0:
        return f"model.moe.capacity_factor={moe.capacity_factor} (Mixtral drops no tokens)"
    return None


def args_to_hf_config(args: TransformerArgs) -> dict:
    """config.json of the LlamaForCausalLM (dense) or MixtralForCausalLM (MoE) equal to a model of `args`."""
    architecture = "MixtralForCausalLM" if args.moe is not None else "LlamaForCausalLM"
    if args.qk_norm:
        raise CheckpointError(f"model.qk_norm=true has no {architecture} equivalent; export is not supported")
    config = {
        "architectures": [architecture],
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
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if args.moe is None:
        config |= {"attention_bias": False, "mlp_bias": False}
    else:
        reason = mixtral_unsupported(args.moe)
        if reason:
            raise CheckpointError(
                f"{reason} has no MixtralForCausalLM equivalent; this MoE model cannot be exported to Hugging Face"
            )
        config |= {
            "model_type": "mixtral",
            "intermediate_size": args.moe.expert_ffn_dim or args.hidden_dim,
            "num_local_experts": args.moe.num_experts,
            "num_experts_per_tok": args.moe.top_k,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
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


def hf_config_to_args(config: dict) -> TransformerArgs:
    """Our model args from a Llama or Mixtral config.json."""
    model_type = config.get("model_type")
    if model_type not in ("llama", "mixtral", None):
        raise CheckpointError(f"model_type {model_type!r} is not supported (llama and mixtral only)")
    heads = config["num_attention_heads"]
    if (config.get("head_dim") or config["hidden_size"] // heads) * heads != config["hidden_size"]:
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
    moe = None
    if model_type == "mixtral":
        if config.get("sliding_window"):
            raise CheckpointError(f"sliding_window={config['sliding_window']} is not supported (full attention only)")
        moe = MoEArgs(
            num_experts=config["num_local_experts"],
            top_k=config["num_experts_per_tok"],
            expert_ffn_dim=config["intermediate_size"],
            router="softmax_topk",
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
        moe=moe,
    )


def read_hf_config(config_file: Path) -> TransformerArgs:
    """Our model args from a config.json; a file that is not JSON or not a Llama/Mixtral config is named."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file}:{err.lineno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{config_file} is not a text file (not valid UTF-8)") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a Llama or Mixtral config (a JSON object)")
    try:
        return hf_config_to_args(config)
    except KeyError as err:
        raise CheckpointError(f"{config_file} lacks {err.args[0]!r}, which a Llama or Mixtral config has") from None
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise CheckpointError(f"{config_file} is not a usable Llama or Mixtral config ({err})") from None


def save_hf(state: dict[str, torch.Tensor], args: TransformerArgs, out_dir: Path) -> None:
    """Write config.json + model.safetensors loadable by LlamaForCausalLM / MixtralForCausalLM.from_pretrained."""
    config = args_to_hf_config(args)  # before writing anything: an unsupported model leaves no folder behind
    tensors = forge_to_hf_state(state, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], TransformerArgs]:
    """Read a Hugging Face Llama or Mixtral folder: (forge state dict, args)."""
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
    if args.tie_embeddings:
        state.pop("output.weight", None)
        state["output.weight"] = state["tok_embeddings.weight"]
    return state, args
