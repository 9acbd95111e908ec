"""Torch's SDPA on a CPU, bf16 against fp32, forward and backward: where forge computes bf16 attention in fp32.

    .venv/bin/python benchmarks/attention/cpu_bf16_sdpa.py [--repeats 5]

Causal attention of random queries, keys and values of each shape (batch, heads, kv heads, keys, head dim), grouped
(enable_gqa) where kv heads < heads, in each dtype in turn; the table gives the median milliseconds of forward +
backward and bf16's ratio to fp32. forge.models.common.attention.CPU_FP32_ATTENTION_MAX (keys x head dim) is the
largest size at which bf16 was slower here: on a CPU, smaller bf16 attention computes in fp32.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import cpu_flags  # noqa: E402

SHAPES = [(8, 8, 4, 256, 32), (8, 16, 8, 256, 16), (8, 4, 4, 256, 64), (2, 8, 4, 1024, 32), (4, 16, 16, 512, 64)]


def step_ms(shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> float:
    """Milliseconds of one causal SDPA forward and backward of `shape` in `dtype`."""
    batch, heads, kv_heads, keys, head_dim = shape
    q = torch.randn(batch, heads, keys, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, keys, head_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, keys, head_dim, dtype=dtype, requires_grad=True)
    start = time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads < heads)
    out.sum().backward()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"cpu sdpa bf16 vs fp32 | cpu flags: {cpu_flags()} | {torch.get_num_threads()} threads | median of {repeats}")
    print(f"{'batch, heads, kv, keys, head dim':<34} {'bf16 ms':>8} {'fp32 ms':>8} {'bf16/fp32':>9}")
    for shape in SHAPES:
        times: dict[torch.dtype, list[float]] = {torch.bfloat16: [], torch.float32: []}
        for dtype in times:
            step_ms(shape, dtype)  # warm-up
        for _ in range(repeats):
            for dtype in times:
                times[dtype].append(step_ms(shape, dtype))
        bf16, fp32 = (statistics.median(times[d]) for d in (torch.bfloat16, torch.float32))
        print(f"{str(shape):<34} {bf16:>8.1f} {fp32:>8.1f} {bf16 / fp32:>9.2f}")


if __name__ == "__main__":
    main()
