"""Step time under forge's host-memory settings, side by side in one run (ratios to forge's default).

    python benchmarks/memory/malloc_step_time.py [--model llama_125m] [--steps 6] [--rounds 2] [--dtype fp32]

forge's default (forge.runtime.host_memory): one process keeps its heap (nothing mmapped, nothing trimmed), several
ranks return freed tensors of 16 MiB or more to the OS (benchmarks/memory/host_peak.py: what that saves), and
torch asks for transparent huge pages for tensors of 2 MiB or more. The other settings: a fixed 16 MiB threshold
with and without huge pages (the latter is forge before the twenty-second session), and glibc's adaptive
threshold without huge pages. One process and 2 FSDP ranks, each with every setting, alternated over rounds; the
step time is the median logged step_time after the first step (which includes warm-up), and the table gives
the median over rounds (one step or one run slowed by another job on a shared machine does not move it).
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
    "forge's default": [],
    "fixed 16 MiB, huge pages": ["train.cpu_mmap_threshold_mib=16"],
    "fixed 16 MiB, no huge pages": ["train.cpu_mmap_threshold_mib=16", "train.cpu_huge_pages=false"],
    "glibc adaptive, no huge pages": ["train.cpu_mmap_threshold_mib=0", "train.cpu_huge_pages=false"],
}


def step_seconds(ranks: int, overrides: list[str], folder: Path) -> float:
    launch = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = [sys.executable, *launch, "-m", "forge.train"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    subprocess.run([*cmd, *overrides, f"hydra.run.dir={folder}"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    times = [r["step_time"] for r in read_records(folder) if "step_time" in r and r["step"] > 1]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama_125m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", help="train.dtype (auto: bf16 where the CPU has native bf16)")
    args = parser.parse_args()
    base = [f"model={args.model}", f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=1", f"train.dtype={args.dtype}", "metrics.console=quiet"]  # fmt: skip
    print(f"CPU bf16 flags: {cpu_flags()}; {os.cpu_count()} cores; model {args.model}, global batch 8, "
          f"train.dtype={args.dtype}, {args.steps} steps, {args.rounds} rounds")  # fmt: skip
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for layout, ranks, extra in (("one process", 1, []), ("2 FSDP ranks", 2, ["parallel=fsdp"])):
                for number, (name, setting) in enumerate(SETTINGS.items()):
                    folder = Path(tmp) / f"{round_}-{ranks}-{number}"
                    times.setdefault((layout, name), []).append(step_seconds(ranks, [*base, *extra, *setting], folder))
    print("| layout | " + " | ".join(SETTINGS) + " |")
    print("|---" * (len(SETTINGS) + 1) + "|")
    for layout in ("one process", "2 FSDP ranks"):
        medians = [statistics.median(times[(layout, name)]) for name in SETTINGS]
        cells = [f"{median * 1e3:.0f} ms ({median / medians[0]:.2f}x)" for median in medians]
        print(f"| {layout} | " + " | ".join(cells) + " |")
    print("(median step time; in brackets, the time over forge's default's: above 1 is slower)")


if __name__ == "__main__":
    main()
