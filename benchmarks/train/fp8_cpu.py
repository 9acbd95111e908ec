"""Float8 matmuls on a CPU: torch's `_scaled_mm` kernel against the emulation forge uses off CUDA (the same float8
operands and scales, dequantised and multiplied in fp32) and a plain fp32 matmul, side by side.

    .venv/bin/python benchmarks/train/fp8_cpu.py [--shapes 256x256x1024,1024x1024x1024 --rounds 3 --threads 0]

Each shape is (rows, inner, columns); after one untimed fp32 and emulated product, the three products alternate
for `--rounds` rounds so machine noise hits each alike, and the table shows the median time and the ratios. The
last column is the largest difference between the kernel's and the emulation's outputs, relative to the output's
largest magnitude.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import cpu_flags  # noqa: E402

E4M3 = torch.float8_e4m3fn


def to_float8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in e4m3 with its per-tensor scale (as torchao's dynamic scaling computes it)."""
    scale = (torch.finfo(E4M3).max / x.abs().max().clamp(min=1e-12)).float()
    return (x * scale).to(E4M3), scale


def timed(fn, *args) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def kernel(a8, b8, a_scale, b_scale):
    """torch's float8 matmul; it takes the scales' inverses."""
    return torch._scaled_mm(a8, b8, a_scale.reciprocal(), b_scale.reciprocal(), out_dtype=torch.float32)


def emulated(a8, b8, a_scale, b_scale):
    """torchao's emulation (Float8LinearConfig(emulate=True)): dequantise in fp32, multiply in fp32."""
    return (a8.float() / a_scale) @ (b8.float() / b_scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="256x256x1024,1024x1024x1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags: {cpu_flags()}")
    print("| rows x inner x cols | fp32 mm (s) | emulated float8 (s) | _scaled_mm (s) | emulated / fp32 | "
          "_scaled_mm / emulated | max difference |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for shape in opts.shapes.split(","):
        m, k, n = (int(d) for d in shape.split("x"))
        a, b = torch.randn(m, k), torch.randn(n, k)
        a8, a_scale = to_float8(a)
        b8, b_scale = to_float8(b)
        b8 = b8.t()  # _scaled_mm takes its second operand column-major
        times: dict[str, list[float]] = {"fp32": [], "emulated": [], "kernel": []}
        outs = {}
        torch.mm(a, b.t()), emulated(a8, b8, a_scale, b_scale)  # warm-up (the kernel's seconds dwarf its own)
        for _ in range(opts.rounds):
            seconds, _ = timed(torch.mm, a, b.t())
            times["fp32"].append(seconds)
            seconds, outs["emulated"] = timed(emulated, a8, b8, a_scale, b_scale)
            times["emulated"].append(seconds)
            seconds, outs["kernel"] = timed(kernel, a8, b8, a_scale, b_scale)
            times["kernel"].append(seconds)
        med = {name: statistics.median(values) for name, values in times.items()}
        diff = (outs["kernel"] - outs["emulated"]).abs().max() / outs["kernel"].abs().max()
        ratios = f"{med['emulated'] / med['fp32']:.2f} | {med['kernel'] / med['emulated']:.0f}"
        print(f"| {shape} | {med['fp32']:.4f} | {med['emulated']:.4f} | {med['kernel']:.4f} | {ratios} | {diff:.1e} |")


if __name__ == "__main__":
    main()
