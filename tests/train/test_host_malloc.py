"""train.cpu_mmap_threshold_mib: with it, a freed tensor above the threshold leaves the process's resident memory;
with glibc's adaptive threshold it stays in the heap. Each case runs in a fresh process (malloc's state is global)."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the knob sets glibc's mallopt")

PROGRAM = """
import sys
from pathlib import Path
import torch
from forge.train.host_malloc import set_mmap_threshold

def rss_mib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

print(set_mmap_threshold(int(sys.argv[1])))
x = torch.ones(6 << 20); del x  # 24 MiB: mmapped at first, and its free raises glibc's adaptive threshold
before = rss_mib()
x = torch.ones(5 << 20); del x  # 20 MiB: below the raised threshold, so from the heap unless fixed at 16
print(rss_mib() - before)
"""


def kept_after_free(threshold_mib: int, env: dict[str, str] | None = None) -> tuple[bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(threshold_mib)],
        capture_output=True, text=True, check=True, env={**os.environ, **(env or {})},
    ).stdout.split()  # fmt: skip
    return out[0] == "True", float(out[1])


def test_a_fixed_threshold_returns_a_freed_20_mib_tensor_to_the_os():
    applied, kept = kept_after_free(16)
    assert applied and kept < 4, f"{kept:.1f} MiB of a freed 20 MiB tensor still resident"


def test_glibcs_adaptive_threshold_keeps_it_and_the_environment_wins():
    assert kept_after_free(0) == (False, pytest.approx(20, abs=4))
    applied, _ = kept_after_free(16, {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)})
    assert not applied
