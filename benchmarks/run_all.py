"""`make bench`: every benchmark, one after the other, each printing its own table."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = [
    ["train/vs_transformers.py"],
    ["train/mfu.py"],
    ["train/startup.py"],
    ["train/exit_cost.py"],
    ["train/chunked_ce.py"],
    ["train/rowwise_ce.py"],
    ["train/weight_casts.py"],
    ["data/bench_data.py"],
    ["checkpoint/save_stall.py"],
    ["moe/moe_vs_dense.py"],
    ["attention/flex_vs_dense.py"],
    ["attention/cpu_bf16_sdpa.py"],
    ["vlm/strategies.py"],
    ["vlm/generate_cache.py"],
]


def main() -> int:
    failed = 0
    for args in BENCHMARKS:
        print(f"\n=== {' '.join(args)} ===", flush=True)
        failed += subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]]).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
