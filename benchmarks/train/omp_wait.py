"""OpenMP's wait policy when processes share the cores: training runs side by side with OpenMP's default (threads
spin while they wait for work) against OMP_WAIT_POLICY=PASSIVE (they sleep), and one run alone each way.

    .venv/bin/python benchmarks/train/omp_wait.py [--runs 2 --steps 15 --rounds 2]

Each case starts `--runs` forge-train processes at once (the default llama_tiny on the embedded corpus, torch's
default thread count each, fp32 or bf16 as train.dtype=auto picks) and records the slowest one's wall time; the
cases alternate for `--rounds` rounds and the table shows the medians. The test suite sets PASSIVE
(tests/conftest.py): its two workers and the ranks they start share the machine's cores.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import cpu_flags  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def wall(policy: str | None, runs: int, steps: int, root: Path) -> float:
    """Seconds until the last of `runs` simultaneous runs ends."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    args = [f"train.steps={steps}", "train.eval_every=0", "train.eval_batches=1", "metrics.console=quiet",
            "checkpoint.interval=0"]  # fmt: skip
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "forge.train", *args, f"hydra.run.dir={root / str(i)}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for i in range(runs)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a run failed: exit codes {codes}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs side by side")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    print(f"CPU flags: {cpu_flags()} | {os.cpu_count()} cores")
    cases = {f"{opts.runs} runs, spinning (default)": (None, opts.runs),
             f"{opts.runs} runs, OMP_WAIT_POLICY=PASSIVE": ("PASSIVE", opts.runs),
             "1 run, spinning (default)": (None, 1), "1 run, OMP_WAIT_POLICY=PASSIVE": ("PASSIVE", 1)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(opts.rounds):
            for name, (policy, runs) in cases.items():
                times[name].append(wall(policy, runs, opts.steps, Path(tmp) / f"{round_}-{len(times[name])}-{runs}"))
    print("| case | wall (s), median | each round |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    med = [statistics.median(values) for values in times.values()]
    print(f"spinning / passive: side by side {med[0] / med[1]:.2f}x, alone {med[2] / med[3]:.2f}x")


if __name__ == "__main__":
    main()
