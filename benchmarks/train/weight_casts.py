"""bf16 gradient accumulation: the weights cast once per optimizer step against once per micro-batch, side by side.

    .venv/bin/python benchmarks/train/weight_casts.py [--shape 1024:4:128:1 --micro-batches 4 --rounds 3
                                                      --device cpu]

A shape is dim:layers:seq:micro_batch (heads = dim / 64, vocab 8192, SwiGLU hidden 4 x dim). Each step is forge's
TextStep (the trainer's forward_backward) over --micro-batches micro-batches of random tokens under bf16 autocast,
with `hold_weight_casts` on (what the trainer picks under bf16 accumulation, forge.train.precision.holds_weight_casts)
and off, alternating for --rounds rounds so that the machine's noise hits both alike. The table gives the median
step time of each, then from one profiled step each the fp32 -> bf16 casts of the weights (aten::_to_copy), their
time and the peak of live tensor bytes, and the ratio of the step times. Without native bf16 (no AVX512-BF16 or
AMX) the bf16 matmuls are emulated and dominate the step, so there the cast time is the figure to read; the ratio
is for a machine with native bf16 or a GPU. Emulated, the default shape takes ~15 minutes on 2 cores; --shape
256:4:128:1 takes ~1.5.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import cpu_flags, synchronizer  # noqa: E402
from benchmarks.train.mfu import shape_args  # noqa: E402
from forge.metrics.memory import peak_live_tensor_bytes  # noqa: E402
from forge.models.llama import build_transformer  # noqa: E402
from forge.train.losses import CrossEntropyLoss  # noqa: E402
from forge.train.steps import TextStep  # noqa: E402

VOCAB = 8192


LOSS = CrossEntropyLoss()


def is_fp32_matrix(event) -> bool:
    return bool(event.input_shapes) and len(event.input_shapes[0]) == 2 and event.input_dtypes[0] == "float"


def cast_profile(step: TextStep, batches: list, sync) -> tuple[int, float, int]:
    """(fp32 -> bf16 casts, their milliseconds, the peak of live tensor bytes) in one step, from torch.profiler."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        step.forward_backward(batches, LOSS)
        sync()
    # a weight is 2-D and fp32 (the activations' casts are 3-D, the gradients' come from bf16)
    events = [e for e in prof.events() if e.name == "aten::_to_copy" and is_fp32_matrix(e)]
    return len(events), sum(e.cpu_time_total for e in events) / 1e3, peak_live_tensor_bytes(prof)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1024:4:128:1", help="dim:layers:seq:micro_batch")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args()
    dim, layers, seq, micro = (int(part) for part in opts.shape.split(":"))
    device = torch.device(opts.device)
    sync = synchronizer(device)
    args = shape_args(dim, layers, seq, VOCAB)
    model = build_transformer(args, device)
    step = TextStep(model, device, "bf16")
    batches = []
    for _ in range(opts.micro_batches):
        tokens = torch.randint(0, VOCAB, (micro, seq + 1))
        batches.append((tokens[:, :-1], tokens[:, 1:]))

    times: dict[bool, list[float]] = {True: [], False: []}
    step.forward_backward(batches, LOSS)  # warm-up
    for _ in range(opts.rounds):
        for hold in (True, False):
            step.hold_weight_casts = hold
            model.zero_grad(set_to_none=True)
            sync()
            start = time.perf_counter()
            step.forward_backward(batches, LOSS)
            sync()
            times[hold].append(time.perf_counter() - start)
    profiles = {}
    for hold in (True, False):
        step.hold_weight_casts = hold
        model.zero_grad(set_to_none=True)
        profiles[hold] = cast_profile(step, batches, sync)

    print(f"{opts.device}; CPU bf16 flags: {cpu_flags()}; {torch.get_num_threads()} threads; dim {dim}, "
          f"{layers} layers, seq {seq}, micro-batch {micro} x {opts.micro_batches}; {opts.rounds} rounds")  # fmt: skip
    print("| weights cast | step s (median) | weight casts per step | cast ms per step | peak live tensors MiB |")
    print("|---|---|---|---|---|")
    for hold, label in ((False, "per micro-batch"), (True, "once per step")):
        count, ms, peak = profiles[hold]
        print(f"| {label} | {statistics.median(times[hold]):.3f} | {count} | {ms:,.1f} | {peak / 2**20:,.1f} |")
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"step time, per micro-batch / once per step: {ratio:.3f}x")


if __name__ == "__main__":
    main()
