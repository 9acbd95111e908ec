"""GPT-2's Hugging Face format (forge.models.spec.HFAdapter): transformers' GPT2LMHeadModel folders.

Our parameters are GPT-2's tensors one to one, under `transformer.` (wte, wpe, h.{i}.*, ln_f) where ours are
tok_embeddings, pos_embeddings, layers.{i}.* and norm; the head is `lm_head.weight` only when untied. The one
layout difference: the fused attention projection is (dim, 3 * dim) in the folder and (dim, 3, dim) here (its
bias (3 * dim,) and (3, dim)), so a box of ours (rows, parts, columns) is read as one box of the folder's columns
per part. Folders saved from a bare GPT2Model (openai-community/gpt2 itself) name the same tensors without the
`transformer.` prefix; both are read. The causal-mask buffers old exports saved (attn.bias, attn.masked_bias) are
ignored.
"""

from pathlib import Path

import torch

from forge.checkpoint.errors import CheckpointError
from forge.models.gpt2.args import GPT2Args

PREFIX = "transformer."
_TOP = {"tok_embeddings": "wte", "pos_embeddings": "wpe", "norm": "ln_f"}
_BLOCK = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
"""A block's modules, named alike on both sides."""
_BUFFERS = (".attn.bias", ".attn.masked_bias")
_HEAD = "lm_head.weight"
GPT2_END_OF_TEXT = 50256
"""The id of GPT-2's <|endoftext|>, GPT2Config's default bos_token_id and eos_token_id."""
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""HF's names of the tanh-approximated GELU that GPT-2 uses (the same function, two implementations)."""
_DEFAULTS = {
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "vocab_size": 50257,
    "n_positions": 1024,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
}
"""transformers' GPT2Config defaults, which it applies to a config.json that leaves a field out."""
_ALIASES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
}
"""transformers' other names of GPT-2's fields (GPT2Config.attribute_map), which a config.json may use."""
_UNSUPPORTED = {
    "scale_attn_weights": (False, "forge scales attention scores by 1 / sqrt(head_dim)"),
    "scale_attn_by_inverse_layer_idx": (True, "forge does not scale attention by the layer index"),
    "reorder_and_upcast_attn": (True, "forge's SDPA does not reorder and upcast the attention scores"),
    "add_cross_attention": (True, "forge's GPT-2 is a decoder without cross-attention"),
}
"""config.json flags whose non-default value the family cannot build: (that value, why)."""


def hf_name(key: str) -> str:
    """The folder's name of our parameter `key` (with the `transformer.` prefix)."""
    if key == "output.weight":
        return _HEAD
    module, _, leaf = key.rpartition(".")
    if module in _TOP:
        return f"{PREFIX}{_TOP[module]}.{leaf}"
    parts = module.split(".")
    if parts[0] == "layers" and len(parts) > 2 and ".".join(parts[2:]) in _BLOCK:
        return f"{PREFIX}h.{parts[1]}.{'.'.join(parts[2:])}.{leaf}"
    raise CheckpointError(f"key '{key}' has no Hugging Face GPT-2 equivalent")


def our_key(name: str) -> str | None:
    """Our parameter key of a folder's tensor `name` (prefixed or bare); None for an ignored buffer."""
    if name == _HEAD:
        return "output.weight"
    bare = name.removeprefix(PREFIX)
    if bare.endswith(_BUFFERS):
        return None
    module, _, leaf = bare.rpartition(".")
    top = {hf: ours for ours, hf in _TOP.items()}
    if module in top and leaf in ("weight", "bias"):
        return f"{top[module]}.{leaf}"
    parts = module.split(".")
    if parts[0] == "h" and len(parts) > 2 and parts[1].isdigit() and ".".join(parts[2:]) in _BLOCK:
        return f"layers.{parts[1]}.{'.'.join(parts[2:])}.{leaf}"
    raise CheckpointError(f"unexpected Hugging Face GPT-2 key '{name}'")


def _setting(config: dict, key: str):
    """A config.json field, under its GPT-2 name or transformers' alias, else GPT2Config's default."""
    if key in config:
        return config[key]
    return config.get(_ALIASES.get(key, key), _DEFAULTS[key])


class GPT2HF:
    """forge.models.spec.HFAdapter of GPT-2."""

    model_types = ("gpt2",)

    def config_to_args(self, config: dict) -> GPT2Args:
        model_type = config.get("model_type", "gpt2")
        if model_type not in self.model_types:
            raise CheckpointError(f"model_type {model_type!r} is not a GPT-2 config (gpt2 only)")
        activation = config.get("activation_function", "gelu_new")
        if activation not in _ACTIVATIONS:
            raise CheckpointError(f"activation_function={activation!r} is not supported (GPT-2's gelu_new only)")
        for flag, (value, why) in _UNSUPPORTED.items():
            if config.get(flag, not value) == value:
                raise CheckpointError(f"{flag}={str(value).lower()} is not supported ({why})")
        dim, heads, inner = _setting(config, "n_embd"), _setting(config, "n_head"), config.get("n_inner")
        if dim % heads:
            raise CheckpointError(f"n_embd={dim} is not divisible by n_head={heads}")
        return GPT2Args(
            dim=dim,
            n_layers=_setting(config, "n_layer"),
            n_heads=heads,
            vocab_size=_setting(config, "vocab_size"),
            max_seq_len=_setting(config, "n_positions"),
            ffn_dim=None if inner in (None, 4 * dim) else inner,
            norm_eps=_setting(config, "layer_norm_epsilon"),
            tie_embeddings=config.get("tie_word_embeddings", True),
            init_std=_setting(config, "initializer_range"),
        )

    def args_to_config(self, args: GPT2Args) -> dict:
        """GPT2LMHeadModel's config; dropout 0, as forge's GPT-2 has none."""
        config = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": args.vocab_size,
            "n_positions": args.max_seq_len,
            "n_embd": args.dim,
            "n_layer": args.n_layers,
            "n_head": args.n_heads,
            "n_inner": None if args.hidden_dim == 4 * args.dim else args.hidden_dim,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": args.norm_eps,
            "initializer_range": args.init_std,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": args.tie_embeddings,
        }
        if args.vocab_size <= GPT2_END_OF_TEXT:  # GPT2Config's default bos / eos, GPT-2's <|endoftext|>, is not a token
            config |= {"bos_token_id": None, "eos_token_id": None}
        return config

    def check_config(self, theirs: GPT2Args, args: GPT2Args, config_file: Path) -> None:
        """`theirs` (config.json's arguments) builds the model of `args`: CheckpointError naming the first field
        that differs."""
        fields = (
            ("n_embd", "dim"),
            ("n_layer", "n_layers"),
            ("n_head", "n_heads"),
            ("vocab_size", "vocab_size"),
            ("n_positions", "max_seq_len"),
            ("n_inner", "hidden_dim"),
            ("layer_norm_epsilon", "norm_eps"),
        )
        for hf, ours in fields:
            if getattr(theirs, ours) != getattr(args, ours):
                setting = "model.ffn_dim" if ours == "hidden_dim" else f"model.{ours}"
                raise CheckpointError(
                    f"{config_file} has {hf}={getattr(theirs, ours)} but {setting}={getattr(args, ours)}: the weights "
                    "do not fit this model"
                )
        if args.tie_embeddings and not theirs.tie_embeddings:
            raise CheckpointError(
                f"{config_file} has tie_word_embeddings=False but model.tie_embeddings=True: the weights do not fit "
                "this model"
            )

    def entries(self, key: str, shape: tuple[int, ...], args: GPT2Args) -> list[tuple[str, tuple[int, ...]]]:
        """The fused attention projection flattens its parts; a tied head is the embedding, not written."""
        if key == "output.weight" and args.tie_embeddings:
            return []
        if key.endswith("attn.c_attn.weight"):
            return [(hf_name(key), (shape[0], shape[1] * shape[2]))]
        if key.endswith("attn.c_attn.bias"):
            return [(hf_name(key), (shape[0] * shape[1],))]
        return [(hf_name(key), tuple(shape))]

    def to_hf(self, key: str, tensor: torch.Tensor, args: GPT2Args) -> list[torch.Tensor]:
        return [tensor.reshape(shape) for _, shape in self.entries(key, tuple(tensor.shape), args)]

    def read(self, key: str, shape: tuple[int, ...], box: tuple[slice, ...], weights, args: GPT2Args) -> torch.Tensor:
        """`weights`: the folder's tensors (forge.checkpoint.hf.HFWeights: `read(name, shape, box)` and the names
        in `files`), or that read function alone (then the names are taken to carry the `transformer.` prefix)."""
        fetch = getattr(weights, "read", weights)
        files = getattr(weights, "files", None)
        name = hf_name(key)
        if key == "output.weight" and (args.tie_embeddings or (files is not None and name not in files)):
            name = hf_name("tok_embeddings.weight")  # tied here or in the folder: the head is the embedding
        if files is not None and name not in files and name.removeprefix(PREFIX) in files:
            name = name.removeprefix(PREFIX)  # saved from a bare GPT2Model
        if not key.endswith("attn.c_attn.weight") and not key.endswith("attn.c_attn.bias"):
            return fetch(name, tuple(shape), box)
        # (dim, 3, dim) / (3, dim): each part of the box is a range of the folder's (.., 3 * dim) columns
        (_, hf_shape), width = self.entries(key, shape, args)[0], shape[-1]
        *rows, parts, cols = box
        first, last, _ = cols.indices(width)
        pieces = [
            fetch(name, hf_shape, (*rows, slice(p * width + first, p * width + last)))
            for p in range(*parts.indices(shape[-2]))
        ]
        return torch.stack(pieces, dim=len(rows))

    def our_keys(self, hf_names: set[str], args: GPT2Args) -> set[str]:
        provided = {key for key in map(our_key, hf_names) if key is not None}
        if "tok_embeddings.weight" in provided:
            provided.add("output.weight")  # a tied folder: see read
        return provided
