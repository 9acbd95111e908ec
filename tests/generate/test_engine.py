"""KV-cache generation against recomputing the whole sequence, and the sampling filters."""

import pytest
import torch

from forge.generate.engine import generate
from forge.generate.sampling import filter_logits, next_token
from forge.models.common.kv_cache import KVCache
from forge.models.llama import TransformerArgs, build_transformer

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    args = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=VOCAB, max_seq_len=64)
    return build_transformer(args, seed=3).eval()


PROMPTS = [[5, 17, 3, 44, 9, 1, 2], [8], [60, 61, 62]]


def recompute_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """The plain forward over the whole unpadded sequence at every step, one prompt at a time."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def test_cached_forward_matches_full_forward(model):
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        parts = [model(tokens[:, :5], cache=cache)] + [model(tokens[:, i : i + 1], cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 12


def test_greedy_batch_with_cache_equals_recomputing_each_prompt_alone(model):
    got = generate(model, PROMPTS, max_new_tokens=12)
    assert got == [recompute_greedy(model, p, 12) for p in PROMPTS]
    assert all(len(g) == 12 for g in got)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (10, 0.9)])
def test_seeded_sampling_with_cache_equals_recomputation(model, top_k, top_p):
    kwargs = dict(max_new_tokens=15, temperature=1.3, top_k=top_k, top_p=top_p, seed=7)
    cached = generate(model, PROMPTS, **kwargs)
    assert cached == generate(model, PROMPTS, use_cache=False, **kwargs)
    assert cached == generate(model, PROMPTS, **kwargs)  # reproducible
    assert cached != generate(model, PROMPTS, **{**kwargs, "seed": 8})


def test_eos_stops_each_sequence(model):
    free = generate(model, PROMPTS, max_new_tokens=10)
    eos = free[0][3]
    got = generate(model, PROMPTS, max_new_tokens=10, eos_id=eos)
    for g, f in zip(got, free):
        assert g == (f[: f.index(eos)] if eos in f else f)


def test_filters_against_hand_computed_sets():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).nonzero()[:, 1].tolist() == [1, 3]
    # sorted 0.4, 0.3, 0.15, ...: 0.4 + 0.3 < 0.75 so 0.15 is needed too
    assert torch.isfinite(filter_logits(logits, top_p=0.75)).nonzero()[:, 1].tolist() == [1, 3, 4]
    assert torch.isfinite(filter_logits(logits, top_p=0.7)).nonzero()[:, 1].tolist() == [1, 3]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).nonzero()[:, 1].tolist() == [1]
    assert next_token(logits).tolist() == [1]
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([next_token(logits, 1.0, top_k=2, generator=gen) for _ in range(400)])
    assert set(draws.flatten().tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 0.4 / 0.7) < 0.08


def test_captured_block_outputs_equal_running_the_blocks_by_hand(model):
    from forge.generate.activations import capture_activations

    batches = [torch.randint(0, VOCAB, (2, 10)), torch.randint(0, VOCAB, (3, 10))]
    acts = capture_activations(model, batches, ["layers.*", "layers.*.attention"])
    assert set(acts) == {"layers.0", "layers.1", "layers.0.attention", "layers.1.attention"}
    assert acts["layers.1"].shape == (5, 10, 64)
    with torch.no_grad():
        h = model.tok_embeddings(torch.cat(batches))
        cos, sin = model.rope_cos[:10], model.rope_sin[:10]
        block0 = model.layers["0"](h, cos, sin)
        attention1 = model.layers["1"].attention(model.layers["1"].attention_norm(block0), cos, sin)
        block1 = model.layers["1"](block0, cos, sin)
    torch.testing.assert_close(acts["layers.0"], block0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acts["layers.1.attention"], attention1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acts["layers.1"], block1, rtol=1e-5, atol=1e-6)
