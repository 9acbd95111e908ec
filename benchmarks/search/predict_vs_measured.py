"""The layout search's predictions against measurement: every layout of a small model on N gloo ranks, trained a
few steps, its median step time and peak host memory beside the cost model's prediction with a calibrated profile.

    python benchmarks/search/predict_vs_measured.py            # 4 ranks; calibrates first (torchrun --calibrate)
    python benchmarks/search/predict_vs_measured.py --profile calib/device_profile.json
    python benchmarks/search/predict_vs_measured.py --layouts tp4 pp2_interleaved      # only these rows

Each layout's step time is the median step after the first of a short run, the quickest of --rounds runs taken in
turns over the layouts (load from other jobs only adds time). Prints one row per layout, the Spearman correlation
of predicted and measured step times, and each layout's predicted / measured peak memory per rank. Measured memory
is the highest peak of live tensor bytes over the ranks, as torch's CPU allocator reports it to the profiler
(benchmarks/search/rank_memory.py, a run of its own since recording every allocation slows the steps): the CPU
counterpart of torch.cuda.max_memory_allocated, without the interpreter, glibc's retained heap or the data, which
the process RSS also holds. The CPU flags it ran with are printed first.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # for benchmarks.machine

from benchmarks.machine import cpu_flags  # noqa: E402
from forge.config import compose  # noqa: E402
from forge.metrics.plot import read_records  # noqa: E402
from forge.planning.search.cost import Layout, ModelShape, predict  # noqa: E402
from forge.planning.search.devices import GIB, device_from_profile  # noqa: E402
from forge.planning.search.settings import SearchSettings  # noqa: E402
from forge.train import build  # noqa: E402

GLOBAL_BATCH = 16  # samples per step, whatever the layout; --ranks divides it (4 or 8)
MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.ffn_dim=768", "train.seq_len=128"]
RUN = [f"train.global_batch_size={GLOBAL_BATCH}", "train.dtype=fp32", "train.log_every=1", "train.eval_every=0",
       "train.eval_batches=1", "metrics.console=quiet", "checkpoint.interval=0", "train.threads=1"]  # fmt: skip


def layouts(ranks: int) -> dict[str, Layout]:
    """The layouts of `ranks` ranks, each with the whole global batch in one micro-batch per data-parallel rank."""
    half, quarter = ranks // 2, ranks // 4

    def micro(dp: int) -> int:
        assert GLOBAL_BATCH % dp == 0, f"--ranks {ranks}: {dp} data-parallel ranks do not divide {GLOBAL_BATCH} samples"
        return GLOBAL_BATCH // dp

    rows = {
        "fsdp": Layout(1, ranks, 1, 1, 1, "none", micro(ranks)),
        "fsdp_full_ac": Layout(1, ranks, 1, 1, 1, "full", micro(ranks)),
        "hsdp": Layout(2, half, 1, 1, 1, "none", micro(ranks)),
        "ddp": Layout(ranks, 1, 1, 1, 1, "none", micro(ranks)),
        "tp2_fsdp": Layout(1, half, 2, 1, 1, "none", micro(half)),
        "tp2_fsdp_full_ac": Layout(1, half, 2, 1, 1, "full", micro(half)),
        "tp4" if ranks == 4 else f"tp4_fsdp{quarter}": Layout(1, quarter, 4, 1, 1, "none", micro(quarter)),
        "pp2_1f1b": Layout(1, half, 1, 2, 1, "none", micro(half), "1f1b", 4),
        "pp2_gpipe": Layout(1, half, 1, 2, 1, "none", micro(half), "gpipe", 4),
        "pp2_interleaved": Layout(1, half, 1, 2, 1, "none", micro(half), "interleaved_1f1b", 4),
        "tp2_pp2": Layout(1, quarter, 2, 2, 1, "none", micro(quarter), "1f1b", 4),  # x FSDP from 8 ranks: 3-D
    }
    return rows


def torchrun(ranks: int, args: list[str], run_dir: Path, script: list[str] | None = None):
    """forge-train (or `script`) on `ranks` local processes."""
    target = script or ["-m", "forge.train", *args, f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *target]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def step_seconds(ranks: int, overrides: list[str], steps: int) -> float:
    """Median step seconds after the first of a short run of the layout."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = torchrun(ranks, [*overrides, f"train.steps={steps}"], Path(tmp))
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        timed = [r for r in read_records(Path(tmp)) if "step_time" in r]
    return statistics.median(r["step_time"] for r in timed[1:])


def peak_bytes(ranks: int, overrides: list[str]) -> int:
    """The highest peak of live tensor bytes over the ranks, in a 2-step run under the profiler's memory recording."""
    with tempfile.TemporaryDirectory() as tmp:
        script = [str(ROOT / "benchmarks" / "search" / "rank_memory.py"), tmp, *overrides, "train.steps=2"]
        proc = torchrun(ranks, [], Path(tmp), script)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        return max(json.loads(f.read_text())["peak_bytes"] for f in Path(tmp).glob("rank*.json"))


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="timed runs per layout, in turns; the quickest counts")
    parser.add_argument("--profile", type=Path, help="a device profile (default: calibrate now)")
    parser.add_argument("--layouts", nargs="*", help="only these rows (names as printed; default: all)")
    args = parser.parse_args()
    print(f"CPU flags: {cpu_flags()}; {args.ranks} gloo ranks, {args.steps} steps per layout, {args.rounds} rounds")
    profile = args.profile
    if profile is None:
        calib = Path(tempfile.mkdtemp()) / "calib"
        proc = torchrun(args.ranks, ["--calibrate", "train.threads=1"], calib)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        profile = calib / "device_profile.json"
    device = device_from_profile(profile)
    settings = SearchSettings(compute_efficiency=1.0, comm_efficiency=1.0)  # a measured profile: rates as measured
    known = layouts(args.ranks)
    unknown = sorted(set(args.layouts or ()) - set(known))
    if unknown:
        parser.error(f"--layouts: no layout {', '.join(unknown)} (the layouts: {', '.join(known)})")
    chosen = {name: layout for name, layout in known.items() if not args.layouts or name in args.layouts}
    runs = {name: [*MODEL, *RUN, *layout.overrides()] for name, layout in chosen.items()}
    # Each round times every layout once, so a burst of load from other jobs slows one run of a layout, not all of
    # them; noise only adds time, so the quickest round is the layout's figure.
    seconds = dict.fromkeys(chosen, float("inf"))
    for _ in range(args.rounds):
        for name in chosen:
            seconds[name] = min(seconds[name], step_seconds(args.ranks, runs[name], args.steps))
    rows = []
    for name, layout in chosen.items():
        cfg = compose([*runs[name], f"parallel.world_size={args.ranks}"])
        predicted = predict(layout, ModelShape.of(build.build_meta_model(cfg)), cfg.train, device, settings, "fp32")
        peak = peak_bytes(args.ranks, runs[name])
        rows.append((name, predicted.step, seconds[name], predicted.memory / GIB, peak / GIB))
        print(f"{name:<20} predicted {predicted.step:7.3f} s  measured {seconds[name]:7.3f} s  | peak memory per rank "
              f"predicted {rows[-1][3]:.3f} GiB, measured {rows[-1][4]:.3f} GiB", flush=True)  # fmt: skip
    if len(rows) > 1:
        rho = spearman([r[1] for r in rows], [r[2] for r in rows])
        print(f"Spearman (predicted vs measured step time, {len(rows)} layouts): {rho:.2f}")
    for name, _, _, mem_p, mem_m in rows:
        print(f"  {name:<20} memory predicted / measured {mem_p / mem_m if mem_m > 0 else float('nan'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
