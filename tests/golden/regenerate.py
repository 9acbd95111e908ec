"""Record the golden loss curves (tests/golden/curves.json) and the tolerance each is checked with.

    .venv/bin/python -m tests.golden.regenerate            # every case
    .venv/bin/python -m tests.golden.regenerate moe        # one case

A regeneration changes what "unchanged behaviour" means: its commit must say why the curves moved.

The tolerance comes from the arithmetic, measured here rather than guessed: each case runs twice, once with this
CPU's kernels and once with other kernels forced (ATen's scalar code path, MKL's SSE4.2 GEMM and oneDNN's SSE4.1
code), which changes the order of every floating-point reduction as another CPU generation (AVX2, AVX-512, AMX)
would. The tolerance is SAFETY times that spread (at least FLOOR_ULPS units in the last place of the curve's
largest loss). A third run with the learning rate 1 % higher must then lie well outside it, so the test catches a
real change of that size.
"""

import json
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

from forge.config.schema import OptimizerConfig
from tests.golden.cases import CASES, GOLDEN, max_difference, run_case

OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "DNNL_MAX_CPU_ISA": "SSE41"}
SAFETY = 10.0
FLOOR_ULPS = 64
SENSITIVITY_MARGIN = 3.0
"""The 1 %-learning-rate run must differ by at least this many tolerances."""


def cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return sorted({flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {flag}" in text})


def learning_rate(name: str) -> float:
    for override in CASES[name]["overrides"]:
        if override.startswith("optimizer.lr="):
            return float(override.split("=", 1)[1])
    return OptimizerConfig.lr


def record(name: str) -> dict:
    native = run_case(name)
    other = run_case(name, env=OTHER_KERNELS)
    spread = max_difference(native, other)
    largest = max(max(values) for values in native.values())
    floor = FLOOR_ULPS * largest * torch.finfo(torch.float32).eps
    tolerance = max(SAFETY * spread, floor)
    nudged = run_case(name, extra=[f"optimizer.lr={learning_rate(name) * 1.01!r}"])
    sensitivity = max_difference(native, nudged)
    print(f"{name}: kernel spread {spread:.3g}, tolerance {tolerance:.3g}, lr +1 % moves {sensitivity:.3g}")
    if sensitivity < SENSITIVITY_MARGIN * tolerance:
        raise SystemExit(
            f"{name}: a 1 % learning-rate change ({sensitivity:.3g}) is within {SENSITIVITY_MARGIN}x "
            f"the tolerance ({tolerance:.3g}): the golden test could not see it"
        )
    return {
        **native,
        "kernel_spread": spread,
        "tolerance": tolerance,
        "lr_plus_1_percent_difference": sensitivity,
    }


def main(names: list[str]) -> None:
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"cases": {}}
    for name in names or list(CASES):
        golden["cases"][name] = record(name)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    golden["recorded"] = {
        "commit": commit,
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "other_kernels": OTHER_KERNELS,
        "safety": SAFETY,
        "floor_ulps": FLOOR_ULPS,
    }
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main(sys.argv[1:])
