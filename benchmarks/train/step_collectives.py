"""Step time on 2 gloo ranks: this checkout against an older commit, side by side in one run (ratios).

    .venv/bin/python benchmarks/train/step_collectives.py [--before 7f12a76] [--rounds 3] [--steps 60] [--extra K=V ...]

Made for the change that folded the per-step host syncs and collectives (issue 20, item 5): the non-finite check
and the preemption agreement in one all-reduce and one host sync, the loss averaged over ranks only on log steps,
MoE load tallies only where needed. The older commit runs from a git worktree (its own src/ first on PYTHONPATH);
the two alternate for --rounds rounds, each a fresh `torchrun --nproc_per_node=2` of a small model with short steps,
so that per-step overheads show (`--extra`: overrides for both, e.g. to hold a newer option fixed). The step time
is metrics.jsonl's mean over each log interval, the first interval (warm-up) dropped; the table shows medians over
rounds. CPU flags are printed (bf16 paths differ by machine).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import ROOT, commit_src, cpu_flags  # noqa: E402
from forge.metrics.plot import read_records  # noqa: E402

CASES = {
    "dense": ["model=llama_tiny", "train.seq_len=64", "train.global_batch_size=4"],
    "moe": ["model=moe_tiny", "train.seq_len=64", "train.global_batch_size=4"],
}


def step_times(src: Path, overrides: list[str], run_dir: Path, steps: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "forge.train",
        *overrides, f"train.steps={steps}", "train.log_every=10", "train.eval_every=0", "train.eval_batches=1",
        "train.dtype=fp32", "scheduler.warmup_steps=0", "metrics.console=quiet", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=run_dir.parent, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [r["step_time"] for r in read_records(run_dir) if "step_time" in r][1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="7f12a76", help="the older commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for both commits")
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    with commit_src(args.before) as old, tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for case, overrides in CASES.items():
                for label, src in (("before", old), ("after", ROOT / "src")):
                    run_dir = Path(tmp) / f"{case}-{label}-{round_}"
                    median = statistics.median(step_times(src, [*overrides, *args.extra], run_dir, args.steps))
                    times.setdefault((case, label), []).append(median)
    extra = f", with {' '.join(args.extra)}" if args.extra else ""
    print(f"CPU bf16 flags: {cpu_flags()}; 2 gloo ranks, {args.steps} steps, before = {args.before}{extra}")
    print("| model | before (ms/step) | after (ms/step) | after / before |")
    print("|---|---|---|---|")
    for case in CASES:
        before, after = (statistics.median(times[(case, label)]) * 1e3 for label in ("before", "after"))
        print(f"| {case} | {before:.1f} | {after:.1f} | {after / before:.3f} |")


if __name__ == "__main__":
    main()
