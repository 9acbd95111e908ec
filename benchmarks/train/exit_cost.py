"""What the interpreter's teardown costs a finished command, and what forge.runtime.exit saves of it.

    .venv/bin/python benchmarks/train/exit_cost.py [--rounds 5]

Two fresh processes alternate for --rounds rounds: each imports the trainer (torch, DTensor, dynamo, pipelining)
and ends, one through Python's whole exit, the other through `exit_without_teardown` (threads joined, atexit
handlers run, no module teardown). The table shows the median wall-clock and CPU seconds of each; the difference
is what every rank of every job pays after its work is done.

Last result (2 CPUs, avx512_bf16, --rounds 5): Python's exit 2.83 s wall / 2.92 s CPU, exit_without_teardown
2.16 / 2.26 s.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import cpu_flags  # noqa: E402

IMPORT = "import forge.runtime.exit as runtime_exit; import forge.train.trainer"
ENDINGS = {
    "Python's exit": IMPORT,
    "exit_without_teardown": IMPORT + "; runtime_exit.exit_without_teardown(0)",
}


def timed(code: str) -> tuple[float, float]:
    """(wall, CPU of the child) seconds of one `python -c code`."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    wall = time.perf_counter() - start
    after = os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ENDINGS}
    timed(IMPORT)  # warm the file cache
    for _ in range(rounds):
        for name, code in ENDINGS.items():
            times[name].append(timed(code))
    print(f"exit cost | cpu flags: {cpu_flags()} | {os.cpu_count()} cpus | {rounds} rounds, medians")
    print(f"{'ending':<24} {'wall s':>8} {'cpu s':>8}")
    for name, samples in times.items():
        wall = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        print(f"{name:<24} {wall:>8.2f} {cpu:>8.2f}")


if __name__ == "__main__":
    main()
