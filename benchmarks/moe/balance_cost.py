"""What balanced selection costs: one MoE layer's forward and backward with `balanced_selection` on and off, side by
side in one run, and the solve alone.

    .venv/bin/python benchmarks/moe/balance_cost.py [--tokens 4096 --dim 512 --repeats 10]

Shapes: issue 50's dim 512 with 8 experts top-2 (expert width 1024) and 64 experts top-6 (expert width 256), a
sigmoid router and grouped GEMMs, fp32 on a CPU or bf16 on a GPU. Prints the median time of each and the ratio
on / off.

Last result (CPU flags avx512_bf16, 2 vCPUs, 4096 tokens, fp32):

    shape               off (ms)   on (ms)  on/off  solve (ms)
    8 experts top-2        591.6     590.6    1.00         8.3
    64 experts top-6       584.0     609.3    1.04        34.0

The solve grows with tokens x experts (8 rounds of a top-k over the experts and a k-th value over the tokens), the
experts' GEMMs with tokens x top_k x dim x width; on a GPU, where the GEMMs run far faster, it has not been measured.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import cpu_flags, gpu_note, synchronizer  # noqa: E402
from forge.models.common.moe.args import MoEArgs  # noqa: E402
from forge.models.common.moe.layer import MoE  # noqa: E402
from forge.models.common.moe.router import balancing_offsets  # noqa: E402

SHAPES = {"8 experts top-2": (8, 2, 1024), "64 experts top-6": (64, 6, 256)}


def median_time(fn, repeats: int, sync) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = synchronizer(device)
    print(f"CPU flags: {cpu_flags()}{gpu_note(device)} | {opts.tokens} tokens, dim {opts.dim}, {dtype}")
    print(f"{'shape':<18} {'off (ms)':>9} {'on (ms)':>9} {'on/off':>7} {'solve (ms)':>11}")
    for name, (experts, top_k, hidden) in SHAPES.items():
        times = {}
        for balanced in (False, True):
            torch.manual_seed(0)
            args = MoEArgs(
                num_experts=experts, top_k=top_k, router="sigmoid_topk", balanced_selection=balanced, grouped_mm=True
            )
            layer = MoE(opts.dim, hidden, args).to(device=device, dtype=dtype)
            x = torch.randn(opts.tokens, opts.dim, device=device, dtype=dtype, requires_grad=True)

            def step(layer=layer, x=x):
                layer(x).float().square().mean().backward()

            times[balanced] = median_time(step, opts.repeats, sync)
        choice = torch.rand(opts.tokens, experts, device=device)
        solve = median_time(lambda c=choice, k=top_k: balancing_offsets(c, k), opts.repeats, sync)
        print(f"{name:<18} {times[False] * 1e3:>9.1f} {times[True] * 1e3:>9.1f} {times[True] / times[False]:>7.2f}"
              f" {solve * 1e3:>11.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
