"""`make train` (the default config, unchanged) in tokens/s: this checkout against an older commit, side by side.

    .venv/bin/python benchmarks/train/default_run.py [--before 1247016] [--rounds 3] [--steps 60] [--extra KEY=VALUE]

Each run is `forge-train train.steps=<steps>` in one process, as `make train` runs it (the resolved dtype: bf16 on a
CPU with avx512_bf16 / amx_bf16, fp32 without). The older commit runs from a git worktree (its src/ first on
PYTHONPATH). The two alternate for --rounds rounds, so the machine's noise hits both alike. Tokens/s is
metrics.jsonl's mean over each log interval, the first interval (warm-up) dropped, median over the run; the table
gives the median over rounds, the ratio, and the last logged training loss of each (same data and seed, so the
curves should agree within the dtype's noise).
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


def default_run(src: Path, steps: int, run_dir: Path, extra: list[str]) -> tuple[float, float, float]:
    """(tokens/s, MFU, last training loss) of one default run from `src`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "forge.train", f"train.steps={steps}", *extra, f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    logged = [r for r in read_records(run_dir) if "tokens_per_s" in r]
    timed = logged[1:] or logged
    rate = statistics.median(r["tokens_per_s"] for r in timed)
    return rate, statistics.median(r.get("mfu", float("nan")) for r in timed), logged[-1]["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="1247016", help="the older commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--extra", action="append", default=[], help="an override for both (e.g. train.dtype=fp32)")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float, float]]] = {"before": [], "after": []}
    with commit_src(args.before) as old, tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for label, src in (("before", old), ("after", ROOT / "src")):
                runs[label].append(default_run(src, args.steps, Path(tmp) / f"{label}-{round_}", args.extra))
    print(f"CPU bf16 flags: {cpu_flags()}; {os.cpu_count()} cores; default config, {args.steps} steps, "
          f"{args.rounds} alternating rounds; before = {args.before}; extra: {args.extra}")  # fmt: skip
    print("| commit | tokens/s (median of rounds) | MFU | last loss |")
    print("|---|---|---|---|")
    for label in ("before", "after"):
        rate, mfu, loss = (statistics.median(values) for values in zip(*runs[label], strict=True))
        print(f"| {label} | {rate:,.0f} | {mfu:.1%} | {loss:.4f} |")
    before, after = (statistics.median(r[0] for r in runs[label]) for label in ("before", "after"))
    print(f"after / before: {after / before:.2f}x")


if __name__ == "__main__":
    main()
