"""Host syncs per training step on a GPU: every step between log steps should make none.

    .venv/bin/python benchmarks/train/host_syncs.py [KEY=VALUE ...]    # overrides of the run, e.g. model=llama3_1b

Runs 8 steps (log every 4) of the given config in this process on cuda:0 under torch's sync debug mode, which
warns at each synchronizing CUDA call (a device-to-host copy, `.item()`, a stream or device synchronize), and
prints the calls per step with the Python line that made them. Reading the last step's flags waits on that
step's CUDA event, which the debug mode does not count: it waits for the last step only. Exit 1 when a step other
than a log step (4, 8) synced. Without CUDA it says so and exits 0 (the CPU check is
tests/train/test_step_host_reads.py, a spy on every Python-level host read).
"""

import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from forge.config import compose  # noqa: E402
from forge.train.trainer import Trainer  # noqa: E402

QUIET = (1, 2, 3, 5, 6, 7)


def main(overrides: list[str]) -> int:
    if not torch.cuda.is_available():
        print("host_syncs: no CUDA device; the CPU check is tests/train/test_step_host_reads.py")
        return 0
    args = ["train.device=cuda", "train.steps=8", "train.log_every=4", "train.eval_every=0", "checkpoint.interval=0",
            "scheduler.warmup_steps=2",
            "metrics.console=quiet", *overrides]  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(compose(args), Path(run_dir))
        syncs: dict[int, Counter] = {}
        current = {"step": 0}
        started = trainer.guard.step_started

        def step_started(step=None):
            current["step"] = step
            return started(step)

        trainer.guard.step_started = step_started

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message):
                syncs.setdefault(current["step"], Counter())[f"{filename}:{lineno}"] += 1

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                trainer.fit()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"masked optimizer updates (no host read before the optimizer step): {trainer.masked_updates}")
    for step in range(1, 9):
        calls = syncs.get(step, Counter())
        kind = "log step" if step not in QUIET else "quiet step"
        print(f"step {step} ({kind}): {sum(calls.values())} synchronizing calls")
        for where, count in calls.most_common(5):
            print(f"    {count} x {where}")
    bad = [step for step in QUIET if syncs.get(step)]
    print("PASS: no host sync between log steps" if not bad else f"FAIL: host syncs in steps {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
