import math

import pytest
import torch

from forge.models.common.rope import apply_rope, rope_frequencies, rope_tables
from forge.models.llama import RopeScalingArgs, Transformer, TransformerArgs, build_transformer


def small_args(**overrides) -> TransformerArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96, max_seq_len=64)
    base.update(overrides)
    return TransformerArgs(**base)


def test_shapes_and_stage_slices():
    model = build_transformer(small_args())
    tokens = torch.randint(0, 97, (3, 17))
    assert model(tokens).shape == (3, 17, 97)
    model.output = None
    model.norm = None
    assert model(tokens).shape == (3, 17, 64)
    model.tok_embeddings = None
    assert model(torch.randn(3, 17, 64)).shape == (3, 17, 64)


def test_causality_future_tokens_never_change_past_logits():
    torch.manual_seed(0)
    model = build_transformer(small_args(), seed=1)
    tokens = torch.randint(0, 97, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build_transformer(small_args(n_heads=4, n_kv_heads=2), seed=3)
    mha = Transformer(small_args(n_heads=4, n_kv_heads=4))
    state = gqa.state_dict()
    head_dim = 16
    for key in list(state):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            w = state[key].view(2, head_dim, 64)
            state[key] = w.repeat_interleave(2, dim=0).reshape(4 * head_dim, 64)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", [None, RopeScalingArgs(factor=8.0, original_max_seq_len=32)])
def test_rope_depends_only_on_relative_position(scaling):
    cos, sin = rope_tables(16, 128, 10000.0, scaling)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum()

    for shift in (1, 7, 50):
        torch.testing.assert_close(score(10, 3), score(10 + shift, 3 + shift), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(10, 3), score(10, 4))


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = RopeScalingArgs(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_frequencies(16, 10000.0, scaling)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(ours, rope_frequencies(16, 10000.0, None))


def test_init_statistics():
    args = TransformerArgs(dim=256, n_layers=8, n_heads=8, vocab_size=4096, ffn_dim=512, init_std=0.02)
    model = build_transformer(args, seed=0)
    block = model.layers["0"]
    out_std = 0.02 / math.sqrt(2 * 8)
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02 * 0.987, rel=0.03)  # truncated at 3 std
    assert block.attention.wo.weight.std().item() == pytest.approx(out_std * 0.987, rel=0.03)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(out_std * 0.987, rel=0.03)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert model.output.weight.std().item() == pytest.approx(256**-0.5 * 0.987, rel=0.03)
    assert block.attention.wq.weight.mean().abs().item() < 1e-3
    assert torch.all(block.attention_norm.weight == 1) and torch.all(model.norm.weight == 1)
    assert block.attention.wq.weight.abs().max().item() <= 3 * 0.02 + 1e-6


def test_meta_build_then_init_equals_direct_build():
    args = small_args(qk_norm=True, rope_scaling=RopeScalingArgs(original_max_seq_len=32))
    direct = Transformer(args)
    direct.init_weights(seed=42)
    meta = build_transformer(args, device="cpu", seed=42)
    for (name, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(direct.rope_cos, meta.rope_cos, rtol=0, atol=0)
    tokens = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(direct(tokens), meta(tokens))


def test_tied_embeddings_share_storage():
    model = build_transformer(small_args(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    n_unique = sum(p.numel() for p in model.parameters())
    assert n_unique == sum(p.numel() for p in build_transformer(small_args()).parameters()) - 97 * 64


def test_ffn_size_from_multiplier():
    assert TransformerArgs(dim=4096, ffn_dim_multiplier=1.3, multiple_of=1024).hidden_dim == 14336
    assert TransformerArgs(dim=4096, ffn_dim=11008).hidden_dim == 11008
