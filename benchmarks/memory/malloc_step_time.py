"""Step time with forge's fixed mmap threshold vs glibc's adaptive one, side by side in one run (ratios).

    python benchmarks/memory/malloc_step_time.py [--model llama_125m] [--steps 6] [--rounds 2]

A fixed threshold returns each freed tensor of 16 MiB or more to the OS (train.cpu_mmap_threshold_mib; see
benchmarks/memory/host_peak.py for what it saves), so the next one of that size costs fresh page faults. This
measures what that costs a CPU step: one process and 2 FSDP ranks, each with both settings, alternated over
rounds; the step time is the mean logged step_time after the first step (which includes warm-up).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import ROOT, cpu_flags  # noqa: E402
from forge.metrics.plot import read_records  # noqa: E402

SETTINGS = {
    "fixed 16 MiB (default)": "train.cpu_mmap_threshold_mib=16",
    "glibc adaptive": "train.cpu_mmap_threshold_mib=0",
}


def step_seconds(ranks: int, overrides: list[str], folder: Path) -> float:
    launch = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = [sys.executable, *launch, "-m", "forge.train"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    subprocess.run([*cmd, *overrides, f"hydra.run.dir={folder}"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    times = [r["step_time"] for r in read_records(folder) if "step_time" in r and r["step"] > 1]
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama_125m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    base = [f"model={args.model}", f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=1", "train.dtype=fp32", "metrics.console=quiet"]  # fmt: skip
    print(f"CPU bf16 flags: {cpu_flags()}; {os.cpu_count()} cores; model {args.model}, global batch 8")
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for layout, ranks, extra in (("one process", 1, []), ("2 FSDP ranks", 2, ["parallel=fsdp"])):
                for number, (name, setting) in enumerate(SETTINGS.items()):
                    folder = Path(tmp) / f"{round_}-{ranks}-{number}"
                    times.setdefault((layout, name), []).append(step_seconds(ranks, [*base, *extra, setting], folder))
    for layout in ("one process", "2 FSDP ranks"):
        fixed, adaptive = (statistics.mean(times[(layout, name)]) for name in SETTINGS)
        print(
            f"{layout}: step {fixed:.2f} s fixed vs {adaptive:.2f} s adaptive: fixed / adaptive {fixed / adaptive:.2f}"
        )


if __name__ == "__main__":
    main()
