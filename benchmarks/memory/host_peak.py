"""Peak host memory (VmHWM) per rank: one process vs 4 FSDP ranks training the same model and global batch.

    python benchmarks/memory/host_peak.py [--model llama_125m] [--ranks 4] [--steps 2]

Each process of the run is the real `forge-train`, started through this file so that it writes its own VmHWM
(the high-water mark of its resident set, /proc/self/status) when it exits. Sharded initialisation, FSDP and the
automatic micro-batch (global batch / ranks) should leave the busiest of 4 ranks well under one process's peak;
the ratio is printed. CPU flags are printed too, since bf16 runs differ by machine.
"""

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def run(ranks: int, overrides: list[str], folder: Path, mmap_threshold: int | None) -> list[int]:
    folder.mkdir(parents=True)
    env = {**os.environ, "FORGE_VMHWM_DIR": str(folder), "OMP_NUM_THREADS": "1"}
    if mmap_threshold:  # glibc: a fixed threshold, so freed large tensors go back to the OS instead of the heap
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
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
    parser.add_argument(
        "--mmap-threshold", type=int, default=None, help="MALLOC_MMAP_THRESHOLD_ (bytes) for both runs; default glibc's"
    )
    args = parser.parse_args()
    overrides = [f"model={args.model}", f"train.steps={args.steps}", "train.eval_batches=1", "train.dtype=fp32",
                 "train.eval_every=0", "metrics.console=quiet"]  # fmt: skip
    flags = subprocess.run(
        "grep -o 'avx512_bf16\\|amx_bf16' /proc/cpuinfo | sort -u", shell=True, capture_output=True, text=True
    ).stdout.split()
    with tempfile.TemporaryDirectory() as tmp:
        one = run(1, overrides, Path(tmp) / "one", args.mmap_threshold)
        many = run(args.ranks, [*overrides, "parallel=fsdp"], Path(tmp) / "many", args.mmap_threshold)
    gib = 2**20
    malloc = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "glibc's default malloc"
    cpu = " ".join(flags) or "none"
    print(f"CPU bf16 flags: {cpu}; model {args.model}, global batch 8, {args.steps} steps, {malloc}")
    print(f"one process: VmHWM {one[0] / gib:.2f} GiB")
    print(f"{args.ranks} FSDP ranks: VmHWM " + ", ".join(f"{k / gib:.2f}" for k in many) + " GiB")
    print(f"busiest rank / one process: {max(many) / one[0]:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
    else:
        main()
