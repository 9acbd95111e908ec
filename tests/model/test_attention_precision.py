"""Which precision SDPA computes in under bf16 on a CPU: fp32 for small attention (keys x head dim at most
CPU_FP32_ATTENTION_MAX, where torch's bf16 CPU kernel is the slower), bf16 otherwise; the result is bf16 either way."""

import torch
import torch.nn.functional as F

from forge.models.common.attention import CPU_FP32_ATTENTION_MAX, attend


def qkv(keys: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(keys + head_dim)
    q = torch.randn(2, 4, keys, head_dim, generator=gen).bfloat16()
    k, v = (torch.randn(2, 2, keys, head_dim, generator=gen).bfloat16() for _ in range(2))
    return q, k, v


def test_small_attention_under_bf16_autocast_computes_in_fp32():
    q, k, v = qkv(64, 32)
    assert CPU_FP32_ATTENTION_MAX >= 64 * 32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, None)
    fp32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    bf16 = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp32.bfloat16())
    assert not torch.equal(out, bf16)  # so the comparison above can tell the two apart


def test_larger_attention_and_fp32_runs_keep_their_dtype():
    q, k, v = qkv(512, 64)
    assert CPU_FP32_ATTENTION_MAX < 512 * 64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, None)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    small = [t.float() for t in qkv(64, 32)]
    assert attend(*small, None).dtype == torch.float32
