"""Peak host memory (VmHWM) per rank: one process vs 4 FSDP ranks training the same model and global batch.

    python benchmarks/memory/host_peak.py [--model llama_125m] [--ranks 4] [--steps 2] [--also-adaptive]

Each process of the run is the real `forge-train`, started through this file so that it writes its own VmHWM
(the high-water mark of its resident set, /proc/self/status) when it exits. Sharded initialisation, FSDP and the
automatic micro-batch (global batch / ranks) should leave the busiest of 4 ranks well under one process's peak;
the ratio is printed. CPU flags are printed too, since bf16 runs differ by machine. `--also-adaptive` repeats both
runs with glibc's adaptive mmap threshold (train.cpu_mmap_threshold_mib=0). Both runs are repeated with a fixed
16 MiB threshold, which the default applies to the ranks only (one process keeps its heap).
"""

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import ROOT, cpu_flags  # noqa: E402


def vmhwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def child() -> None:
    """Run forge-train in this process and record its VmHWM at exit (as rank RANK)."""
    out = Path(os.environ["FORGE_VMHWM_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    atexit.register(lambda: out.write_text(json.dumps({"vmhwm_kib": vmhwm_kib()})))
    from forge.train.main import main

    sys.argv = ["forge-train", *sys.argv[2:]]
    main()


def run(ranks: int, overrides: list[str], folder: Path) -> list[int]:
    folder.mkdir(parents=True)
    env = {**os.environ, "FORGE_VMHWM_DIR": str(folder), "OMP_NUM_THREADS": "1"}
    me = [str(Path(__file__).resolve()), "--child"]
    cmd = [sys.executable, *me] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *me]  # fmt: skip
    subprocess.run([*cmd, *overrides, f"hydra.run.dir={folder / 'run'}"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return [json.loads(p.read_text())["vmhwm_kib"] for p in sorted(folder.glob("rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama_125m")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--also-adaptive", action="store_true", help="also with glibc's adaptive mmap threshold")
    args = parser.parse_args()
    overrides = [f"model={args.model}", f"train.steps={args.steps}", "train.eval_batches=1", "train.dtype=fp32",
                 "train.eval_every=0", "metrics.console=quiet"]  # fmt: skip
    print(f"CPU bf16 flags: {cpu_flags()}; model {args.model}, global batch 8, {args.steps} steps")
    mallocs = {
        "forge's default (train.cpu_mmap_threshold_mib=null: one process keeps its heap, ranks fix 16 MiB)": [],
        "a fixed 16 MiB threshold on both (train.cpu_mmap_threshold_mib=16)": ["train.cpu_mmap_threshold_mib=16"],
    }
    if args.also_adaptive:
        mallocs["glibc's adaptive threshold, no huge pages"] = ["train.cpu_mmap_threshold_mib=0",
                                                                "train.cpu_huge_pages=false"]  # fmt: skip
    gib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        for number, (malloc, extra) in enumerate(mallocs.items()):
            one = run(1, [*overrides, *extra], Path(tmp) / f"one{number}")
            many = run(args.ranks, [*overrides, *extra, "parallel=fsdp"], Path(tmp) / f"many{number}")
            print(f"{malloc}:")
            print(f"  one process: VmHWM {one[0] / gib:.2f} GiB")
            print(f"  {args.ranks} FSDP ranks: VmHWM " + ", ".join(f"{k / gib:.2f}" for k in many) + " GiB")
            print(f"  busiest rank / one process: {max(many) / one[0]:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
    else:
        main()
