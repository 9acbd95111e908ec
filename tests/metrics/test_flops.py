"""FLOPs per token against torch's FlopCounterMode on real forward + backward passes."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

import forge.models.common.moe.experts as experts_module
from forge.models.llama.args import MoEArgs, TransformerArgs
from forge.models.llama.transformer import build_transformer
from forge.planning.flops import count_flops_per_token, training_flops_per_token

BATCH, SEQ = 2, 32


@register_flop_formula(torch.ops.aten._grouped_mm)
def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch's counter has no formula for the grouped GEMM (the MoE experts' default): each row of a meets the
    matching part of b once, whether a is (rows, K) by b (groups, K, N) or, for the weight gradient, (K, rows) by
    (rows, N) grouped along the rows."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def tiny(**overrides) -> TransformerArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, max_seq_len=64)
    return TransformerArgs(**{**base, **overrides})


def counted_training_flops(args: TransformerArgs) -> int:
    """FLOPs torch counts for one forward + backward (SDPA's math backend, so attention is visible as bmm)."""
    model = build_transformer(args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).float().pow(2).mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "args",
    [
        tiny(),
        tiny(n_kv_heads=1, tie_embeddings=True),
        tiny(n_kv_heads=None, qk_norm=True),
    ],
    ids=["gqa", "mqa_tied", "mha_qknorm"],
)
def test_dense_count_matches_flop_counter_exactly(args):
    assert counted_training_flops(args) == count_flops_per_token(args, SEQ).training * BATCH * SEQ


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk"])
def test_dropless_moe_count_is_exact_whatever_the_routing(router, grouped, monkeypatch):
    # Dropless: every token runs exactly top_k experts, so the total does not depend on where tokens go.
    # (The CPU's batched GEMMs also multiply their padding rows, work that MFU leaves out: off here.)
    monkeypatch.setattr(experts_module, "BATCHED_PADDING_LIMIT", 0.0)
    moe = MoEArgs(
        num_experts=4, top_k=2, num_shared_experts=1, expert_ffn_dim=48, every=2, router=router, grouped_mm=grouped
    )
    args = tiny(moe=moe)
    assert counted_training_flops(args) == count_flops_per_token(args, SEQ).training * BATCH * SEQ


def test_a_capacity_limited_moe_computes_its_dropped_rows_too(monkeypatch):
    """Dropped assignments ride with the last expert (static shapes, no host sync) and are weighed by 0: the
    FLOPs are the dropless ones, while some were dropped (the grouped GEMMs: the CPU's batched ones add padding)."""
    monkeypatch.setattr(experts_module, "BATCHED_PADDING_LIMIT", 0.0)
    moe = MoEArgs(num_experts=4, top_k=2, expert_ffn_dim=48, every=1, capacity_factor=1.0)
    args = tiny(moe=moe)
    model = build_transformer(args, seed=0)
    assert counted_training_flops(args) == count_flops_per_token(args, SEQ).training * BATCH * SEQ
    model(torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)))
    layers = [m for m in model.modules() if hasattr(m, "last_kept")]
    assert any(layer.last_kept.sum() < layer.last_routed.sum() for layer in layers)  # some were dropped


def test_without_attention_scores_training_flops_are_six_times_the_matmul_parameters():
    args = tiny()
    model = build_transformer(args)
    matmul_params = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in name
    )
    counts = count_flops_per_token(args, SEQ)
    assert counts.training - 3 * counts.attention_scores == 6 * matmul_params
    assert count_flops_per_token(args, 2 * SEQ).attention_scores == 2 * counts.attention_scores


def test_training_flops_from_a_model_and_none_for_an_unknown_one():
    args = tiny()
    assert training_flops_per_token(build_transformer(args), SEQ) == count_flops_per_token(args, SEQ).training
    assert training_flops_per_token(torch.nn.Linear(2, 2), SEQ) is None
