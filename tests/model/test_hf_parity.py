"""Our decoder against transformers' LlamaForCausalLM with the same weights: an independent forward."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forge.models.llama import Transformer, TransformerArgs


def test_logits_match_transformers_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = LlamaForCausalLM(config).eval()
    ours = Transformer(
        TransformerArgs(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=120, ffn_dim=96, max_seq_len=64, norm_eps=1e-5
        )
    ).eval()
    names = {
        "q_proj": "attention.wq",
        "k_proj": "attention.wk",
        "v_proj": "attention.wv",
        "o_proj": "attention.wo",
        "gate_proj": "feed_forward.w1",
        "up_proj": "feed_forward.w3",
        "down_proj": "feed_forward.w2",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    state = {
        "tok_embeddings.weight": hf.model.embed_tokens.weight,
        "norm.weight": hf.model.norm.weight,
        "output.weight": hf.lm_head.weight,
    }
    for key, value in hf.model.layers.state_dict().items():
        layer, *path = key.split(".")
        module = path[-2]
        state[f"layers.{layer}.{names[module]}.weight"] = value
    ours.load_state_dict(state)
    tokens = torch.randint(0, 120, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
