"""The cross-entropy of plain logits, forward and backward, side by side: torch's (F.cross_entropy of the fp32
logits, as transformers computes it), forge's row-wise loss (what an eager step trains with: chunks of 4 MiB of fp32
rows on a CPU, 256 MiB elsewhere), and the compiled cross-entropy that `parallel.compile=true` trains with.

    .venv/bin/python benchmarks/train/rowwise_ce.py [--device cuda --shape 32768:8192 --shape 16384:128256
        --dtype bf16 --repeats 10]

A shape is tokens:vocab; the logits are random, in --dtype, with 1 label in 8 ignored. The contenders run in turns,
each first in a round in turn (the first pays for the memory the last round freed); the table gives the median time
of forward + backward (between CUDA synchronizations on a GPU), its ratio to torch's, and on a GPU the peak memory
allocated beyond the logits and their gradient. The losses are checked against each other first (fp32 rounding of
the same sums: 1e-4 relative).
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.*

from benchmarks.machine import cpu_flags, gpu_note  # noqa: E402
from forge.train import losses  # noqa: E402


def torch_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=losses.IGNORE_INDEX)


def timed(loss_of: Callable, logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Seconds of one forward + backward, and the bytes allocated at its peak beyond those held before it."""
    on_gpu = logits.device.type == "cuda"
    logits.grad = None
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss_of(logits, labels).backward()
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before if on_gpu else float("nan")
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", action="append", help="tokens:vocab (repeatable)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    device = torch.device(opts.device)
    shapes = [tuple(int(x) for x in s.split(":")) for s in opts.shape or ["2048:8192", "1024:32768"]]
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    print(f"cpu flags: {cpu_flags()}{gpu_note(device)} | logits {opts.dtype} | torch {torch.__version__}")
    contenders = {
        "torch F.cross_entropy of fp32 logits": torch_cross_entropy,
        "forge row-wise (eager)": losses.rowwise_cross_entropy,
        "compiled cross-entropy (parallel.compile=true)": losses.compiled_cross_entropy(),
    }
    for tokens, vocab in shapes:
        torch._dynamo.reset()  # else the second shape is compiled for dynamic shapes
        gen = torch.Generator(device).manual_seed(0)
        logits = (4 * torch.randn(1, tokens, vocab, device=device, generator=gen)).to(dtype).requires_grad_()
        labels = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)
        labels[:, ::8] = losses.IGNORE_INDEX
        reference = torch_cross_entropy(logits, labels).item()
        for name, loss_of in contenders.items():
            loss = loss_of(logits, labels)
            loss.backward()  # the warm-up (and compilation), forward and backward
            logits.grad = None
            value = loss.item()
            assert abs(value - reference) <= 1e-4 * abs(reference), (name, value, reference)
        results = {name: [] for name in contenders}
        names = list(contenders)
        for repeat in range(opts.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                results[name].append(timed(contenders[name], logits, labels))
        base = statistics.median(s for s, _ in results["torch F.cross_entropy of fp32 logits"])
        size = logits.numel() * logits.element_size()
        print(f"\n{tokens} tokens x {vocab} vocab ({size / 2**20:,.0f} MiB of logits)")
        print("| loss | forward + backward (ms) | vs torch's | peak beyond the logits (MiB) |")
        print("|---|---|---|---|")
        for name, runs in results.items():
            seconds = statistics.median(s for s, _ in runs)
            peak = max(p for _, p in runs) - size  # less the gradient's own
            print(f"| {name} | {1e3 * seconds:,.2f} | {base / seconds:.2f}x | {peak / 2**20:,.0f} |")


if __name__ == "__main__":
    main()
