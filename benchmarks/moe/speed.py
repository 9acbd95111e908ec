"""MoE training speed against its dense twin, where the MoE step's time goes, and expert parallelism with and
without overlapped all-to-alls: side by side in one run (ratios; these machines are shared and noisy).

    .venv/bin/python benchmarks/moe/speed.py [--rounds 3 --steps 3 --accum 4 --seq 256 --batch 8 --dtype auto
                                              --ep-steps 12] [--skip-ep | --profile-only]

1. One process. Each MoE (4 layers, dim 512, vocab 8192; a step of 4 micro-batches of 8 x 256 tokens, as a run
   with gradient accumulation, so that per-parameter costs weigh as in training) beside its dense twin, a SwiGLU of
   hidden top_k x expert width, so the two have the same active FLOPs per token (the MoE adds its router's
   dim x experts). 8 experts top-2 (width 1024, softmax router) and 64 experts top-6 (width 256, sigmoid router),
   both with balanced selection, each MoE with the default dispatch (grouped GEMMs; on a CPU, batched GEMMs of
   the groups padded to the longest when routing is balanced) and the one-chain-per-expert loop it replaced. The
   step is forward, backward and fused AdamW under autocast in the resolved dtype, as the trainer's. The
   configurations alternate for --rounds rounds; each cell is the median. MFU uses
   forge.planning.flops' count (the trainer's) against the best square-matmul rate measured in the same run; the
   column that matters is "MFU / twin's", which the peak cancels out of.
2. A profile of the 64-expert step beside its twin's: self time per kind of op (torch.profiler), per step.
3. Expert parallelism over 2 gloo ranks (torchrun, one thread each, `model=moe` at dim 512 with 8 experts of width
   1024): `parallel.ep_chunks=1` (the tokens in one all-to-all) against 2 (two parts, the second on the wire while
   the first's experts compute), alternating over --rounds fresh runs; the step time is metrics.jsonl's, the first
   log interval dropped.
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import ROOT, cpu_flags, gpu_note, synchronizer  # noqa: E402
from forge.metrics.plot import read_records  # noqa: E402
from forge.models.llama import MoEArgs, TransformerArgs, build_transformer  # noqa: E402
from forge.planning.flops import count_flops_per_token  # noqa: E402
from forge.planning.peak import measure_matmul_flops  # noqa: E402
from forge.runtime.host_memory import prepare_cpu_process  # noqa: E402
from forge.train.compute_weights import ComputeWeights, scope  # noqa: E402
from forge.train.losses import cross_entropy  # noqa: E402
from forge.train.precision import autocast, resolve_dtype  # noqa: E402

DIM, LAYERS, VOCAB = 512, 4, 8192
SEQ, BATCH = 256, 8  # --seq, --batch
MOES = {  # name: (experts, top_k, expert width, router)
    "8 experts top-2": (8, 2, 1024, "softmax_topk"),
    "64 experts top-6": (64, 6, 256, "sigmoid_topk"),
}
WEIGHT_COPIES = "bf16 weight copies"
OP_KINDS = (  # (kind, substrings of op names), in priority order: an op counts under the first kind that it or
    # any op it runs inside matches (an aten::mm inside torch._grouped_mm's CPU loop is an expert GEMM)
    ("per parameter: bf16 weight copies, fp32 gradient sums", (WEIGHT_COPIES, "AccumulateGrad")),
    ("expert GEMMs (grouped or batched)", ("grouped_mm", "GroupedMm", "aten::bmm", "BmmBackward")),
    ("attention", ("scaled_dot_product", "ScaledDotProduct", "flash_attention")),
    ("optimizer", ("adam", "Optimizer")),
    ("routing (scores, top-k, balancing)", ("topk", "kthvalue", "Topk", "Kthvalue", "sigmoid", "Sigmoid")),
    (
        "dispatch (sort, gather, scatter)",
        ("sort", "index", "Index", "scatter", "Scatter", "gather", "Gather", "repeat_interleave"),
    ),  # fmt: skip
    ("other GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "MmBackward", "AddmmBackward")),
)


def model_args(name: str | None, width: int) -> TransformerArgs:
    """The MoE of `name`, or (name None) the dense twin of hidden `width`."""
    moe = None
    if name is not None:
        experts, top_k, expert_width, router = MOES[name]
        moe = MoEArgs(
            num_experts=experts, top_k=top_k, expert_ffn_dim=expert_width, router=router, balanced_selection=True
        )
    return TransformerArgs(
        dim=DIM, n_layers=LAYERS, n_heads=DIM // 64, vocab_size=VOCAB, ffn_dim=width, max_seq_len=SEQ, moe=moe
    )


class Step:
    """One training step of a model: `accum` micro-batches' forward and backward, then fused AdamW, as the trainer's
    one-process step."""

    def __init__(self, args: TransformerArgs, device: torch.device, dtype: str, grouped: bool = True, accum: int = 1):
        torch.manual_seed(0)
        self.model = build_transformer(args, device)
        for module in self.model.modules():
            if hasattr(module, "use_grouped_mm"):
                module.use_grouped_mm = grouped
        self.weights = ComputeWeights(self.model) if dtype == "bf16" else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.tokens = torch.randint(0, VOCAB, (accum, BATCH, SEQ + 1), device=device)
        self.device, self.dtype = device, dtype
        self.flops = count_flops_per_token(args, SEQ).training

    def __call__(self) -> None:
        with contextlib.ExitStack() as stack:
            with torch.profiler.record_function(WEIGHT_COPIES):
                stack.enter_context(scope(self.weights))  # one bf16 copy of the weights per step, as the trainer's
            for tokens in self.tokens:
                with autocast(self.device, self.dtype):
                    logits = self.model(tokens[:, :-1])
                cross_entropy(logits, tokens[:, 1:]).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def one_process(opts, device: torch.device, dtype: str) -> None:
    sync = synchronizer(device)
    runs: dict[str, Step] = {}
    for name, (_, top_k, width, _) in MOES.items():
        runs[f"{name}: dense twin"] = Step(model_args(None, top_k * width), device, dtype, accum=opts.accum)
        runs[f"{name}: MoE, default dispatch"] = Step(model_args(name, top_k * width), device, dtype, accum=opts.accum)
        runs[f"{name}: MoE, loop per expert"] = Step(
            model_args(name, top_k * width), device, dtype, grouped=False, accum=opts.accum
        )
    seconds: dict[str, list[float]] = defaultdict(list)
    for step in runs.values():
        step()  # warm-up
    for _ in range(opts.rounds):
        for label, step in runs.items():
            sync()
            start = time.perf_counter()
            for _ in range(opts.steps):
                step()
            sync()
            seconds[label].append((time.perf_counter() - start) / opts.steps)
    peak = max(measure_matmul_flops(device, dtype, size, 0.5) for size in (1024, 2048))
    print(
        f"\n1. One process, {dtype}, {torch.get_num_threads()} threads, {opts.accum} micro-batches of {BATCH} x {SEQ} "
        f"tokens per step, square-matmul peak {peak / 1e9:,.0f} GFLOP/s"
    )
    print("| model | step (s) | tokens/s | training GFLOP/token | MFU | MFU / twin's |")
    print("|---|---|---|---|---|---|")
    twin_mfu = 0.0
    for label, step in runs.items():
        tokens_per_s = opts.accum * BATCH * SEQ / statistics.median(seconds[label])
        mfu = step.flops * tokens_per_s / peak
        twin_mfu = mfu if label.endswith("twin") else twin_mfu
        print(
            f"| {label} | {statistics.median(seconds[label]):.3f} | {tokens_per_s:,.0f} | {step.flops / 1e9:.3f} | "
            f"{100 * mfu:.1f}% | {mfu / twin_mfu:.2f} |"
        )


def profile(device: torch.device, dtype: str, accum: int, name: str = "64 experts top-6", steps: int = 2) -> None:
    """Self time per kind of op, per step, of the MoE and of its twin (torch.profiler)."""
    _, top_k, width, _ = MOES[name]
    columns = {}
    for label, moe in (("dense twin", None), ("MoE", name)):
        step = Step(model_args(moe, top_k * width), device, dtype, accum=accum)
        step()
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
        )
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            synchronizer(device)()
        by_kind: dict[str, float] = defaultdict(float)
        for event in prof.events():
            by_kind[op_kind(event)] += event.self_cpu_time_total / 1e3 / steps
        columns[label] = by_kind
    print(f"\n2. Where the {name} step's time goes ({dtype}, self CPU time per step in ms, torch.profiler)")
    print("| kind of op | dense twin | MoE |")
    print("|---|---|---|")
    kinds = sorted(columns["MoE"], key=lambda kind: -columns["MoE"][kind])
    for kind in kinds:
        print(f"| {kind} | {columns['dense twin'].get(kind, 0.0):,.0f} | {columns['MoE'][kind]:,.0f} |")
    totals = {label: sum(values.values()) for label, values in columns.items()}
    print(f"| all | {totals['dense twin']:,.0f} | {totals['MoE']:,.0f} |")


def op_kind(event) -> str:
    """The first kind of OP_KINDS that the event or one of the ops it runs inside matches."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    for kind, parts in OP_KINDS:
        if any(part in name for name in names for part in parts):
            return kind
    return "elementwise and other"


def ep_step_time(chunks: int, steps: int, run_dir: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "forge.train",
        "model=moe", f"model.dim={DIM}", f"model.n_layers={LAYERS}", "model.n_heads=8", "model.moe.expert_ffn_dim=1024",
        "parallel.ep=2", f"parallel.ep_chunks={chunks}", f"train.seq_len={SEQ}", "train.global_batch_size=8",
        "train.micro_batch_size=4", f"train.steps={steps}", "train.log_every=4", "train.eval_every=0",
        "train.eval_batches=1", "train.threads=1", "checkpoint.interval=0", "metrics.console=quiet",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    timed = [r["step_time"] for r in read_records(run_dir) if "step_time" in r]
    return statistics.mean(timed[1:])


def expert_parallel(opts) -> None:
    times: dict[int, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(opts.rounds):
            for chunks in (1, 2):
                times[chunks].append(ep_step_time(chunks, opts.ep_steps, Path(tmp) / f"{chunks}-{round_}"))
    print("\n3. Expert parallelism over 2 gloo ranks (model=moe at dim 512, 8 experts of width 1024, 1 thread each)")
    print("| parallel.ep_chunks | step (s), median | each round |")
    print("|---|---|---|")
    for chunks, values in times.items():
        print(f"| {chunks} | {statistics.median(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    print(f"two parts / one: {statistics.median(times[2]) / statistics.median(times[1]):.2f}")


def main() -> None:
    global SEQ, BATCH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    parser.add_argument("--ep-steps", type=int, default=12, help="steps of each expert-parallel run")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per micro-batch")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-ep", action="store_true", help="leave out part 3 (torchrun on 2 ranks)")
    parser.add_argument("--profile-only", action="store_true", help="part 2 alone")
    opts = parser.parse_args()
    SEQ, BATCH = opts.seq, opts.batch
    device = torch.device(opts.device)
    if device.type == "cpu":  # the heap and huge pages as the forge-train command keeps them
        print(prepare_cpu_process(huge_pages_wanted=True, mmap_threshold_mib=None, world_size=1))
    dtype = resolve_dtype(opts.dtype, device)
    print(f"CPU flags: {cpu_flags()}{gpu_note(device)} | torch {torch.__version__}")
    if not opts.profile_only:
        one_process(opts, device, dtype)
    profile(device, dtype, opts.accum)
    if not opts.skip_ep and not opts.profile_only and device.type == "cpu":
        expert_parallel(opts)


if __name__ == "__main__":
    main()
