"""train.cpu_mmap_threshold_mib and train.cpu_huge_pages: where a CPU run's freed and fresh tensors live. With a
fixed threshold a freed tensor above it leaves the process's resident memory; with glibc's adaptive threshold it stays
in the heap; one process keeps its heap and reuses it without page faults; huge pages cut a fresh tensor's faults.
Each case runs in a fresh process (malloc's state and torch's switch are global)."""

import os
import platform
import re
import subprocess
import sys

import pytest

from forge.runtime.host_memory import THP_SWITCH
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the knob sets glibc's mallopt")

THP_MODE = re.search(r"\[(\w+)\]", THP_SWITCH.read_text()).group(1) if THP_SWITCH.is_file() else "never"
"""The kernel's transparent huge pages: `always` gives them to every fresh mapping, so fresh tensors fault less."""

PROGRAM = """
import sys
from pathlib import Path
import torch
from forge.runtime.host_memory import set_mmap_threshold

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


FAULTS = """
import resource, sys
from pathlib import Path
import torch
from forge.runtime.host_memory import configure_host_malloc

def rss_mib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

print(configure_host_malloc(None, int(sys.argv[1])))
faults, rss = [], []
for step in range(12):  # a step's 40 MiB tensor, above any mmap threshold glibc allows, and a small one after it
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(10 << 20); y = x.sum(); del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    rss.append(rss_mib())
print(sum(faults[8:]), rss[11] - rss[8])  # the heap settles within 6 steps here
"""


def late_steps(world_size: int, env: dict[str, str] | None = None) -> tuple[str, int, float]:
    """(what was done, page faults of steps 9-12, resident MiB added over them)."""
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, str(world_size)],
        capture_output=True, text=True, check=True, env={**os.environ, **(env or {})},
    ).stdout.splitlines()  # fmt: skip
    faults, grown = out[1].split()
    return out[0], int(faults), float(grown)


def test_one_process_reuses_its_heap_and_several_ranks_return_large_tensors():
    pages = 4 * (40 << 20) // 4096
    done, faults, grown = late_steps(1)
    assert done == "heap kept" and faults < pages // 20, f"{faults} page faults over 4 steps of a reused 40 MiB"
    assert abs(grown) < 8, f"the kept heap still grew by {grown:.0f} MiB over steps 9-12"  # it settles
    fresh_pays = THP_MODE != "always"  # else each fresh mapping gets huge pages: a fault per 2 MiB
    done, faults, _ = late_steps(4)
    assert done == "mmap threshold 16 MiB" and (faults > pages * 9 // 10 or not fresh_pays), f"{faults} page faults"
    done, faults, _ = late_steps(1, {"MALLOC_TRIM_THRESHOLD_": str(1 << 20)})
    assert done == "glibc's own" and (faults > pages * 9 // 10 or not fresh_pays), f"{faults} page faults"


HUGE_PAGES = """
import resource, sys
import torch
from forge.runtime.host_memory import ask_huge_pages

if sys.argv[1] == "late":
    torch.ones(1)  # the process has allocated: torch has read its switch already
print(ask_huge_pages())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20)  # 64 MiB, fresh
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(THP_MODE != "madvise", reason=f"the kernel's transparent huge pages are {THP_MODE}, not madvise")
def test_huge_pages_cut_a_fresh_tensors_page_faults_where_asked_in_time():
    pages = (64 << 20) // 4096

    def run(when: str) -> tuple[bool, int]:
        out = subprocess.run([sys.executable, "-c", HUGE_PAGES, when], capture_output=True, text=True, check=True)
        took, faults = out.stdout.split()
        return took == "True", int(faults)

    took, faults = run("first")
    assert took and faults < pages // 8, f"{faults} page faults for a fresh 64 MiB with huge pages"
    took, faults = run("late")
    assert not took and faults >= pages, f"asked too late, yet {faults} page faults"


def test_the_command_applies_both_before_the_trainers_imports(tmp_path):
    """forge-train on one CPU process keeps its heap and gets huge pages: nothing it imports first allocates."""
    proc = subprocess.run(
        [sys.executable, "-m", "forge.train", "train.device=cpu", "train.steps=1", "train.eval_batches=1",
         "model.n_layers=1", f"hydra.run.dir={tmp_path}"],  # a fresh interpreter, not forge_cmd's warm fork
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    pages = "off" if THP_MODE == "never" else "on"
    assert f"host memory: heap kept; transparent huge pages {pages}" in proc.stdout + proc.stderr
