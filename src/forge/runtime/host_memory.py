"""Host memory when the training device is the CPU: where glibc puts freed tensors, and huge pages for fresh ones.

glibc serves a large allocation with mmap and returns it to the OS when freed, but each such free raises its
threshold (up to 32 MiB), so the next allocations of that size come from the heap and stay there once freed.

- Several ranks: a FSDP rank gathers, frees and regathers each block's parameters (tens of MiB at llama_125m); held
  in the heap, they fragment it and the rank's resident memory grows by what it freed (benchmarks/memory/host_peak.py
  measures it). A fixed threshold sends tensors of at least that size back to the OS at once.
- One process: a step's tensors of 32 MiB and more (the logits and their gradient at the default config) are
  mmapped afresh at every step, and the kernel zeroes each 4 KiB page on its first touch. There the heap serves
  everything and is never trimmed, so a step reuses the last step's memory (benchmarks/memory/malloc_step_time.py).

Fresh large tensors fault once per 2 MiB instead of once per 4 KiB where torch asks for transparent huge pages
(its THP_MEM_ALLOC_ENABLE: tensors of 2 MiB or more are page aligned and madvised): a fresh 64 MiB tensor then
faults 32 times plus its bookkeeping instead of 16,384 times.
"""

import ctypes
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("forge")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
DEFAULT_MMAP_MAX = 65536  # glibc's own count of mmapped chunks (DEFAULT_MMAP_MAX)
MAX_THRESHOLD_MIB = 32  # glibc refuses more on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
RANKS_THRESHOLD_MIB = 16  # the automatic choice on several ranks (measured in benchmarks/memory/host_peak.py)
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before glibc gives any back
ENVIRONMENT_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
TUNABLE_KNOBS = tuple(f"glibc.malloc.{name}" for name in ("mmap_threshold", "mmap_max", "trim_threshold", "top_pad"))
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch reads it once, at the process's first CPU allocation
THP_MIN_BYTES = 2 << 20  # torch's threshold (gAlloc_threshold_thp)
THP_SWITCH = Path("/sys/kernel/mm/transparent_hugepage/enabled")


PREPARED = False
"""Set once the command has prepared this process (forge.train.main.build_trainer); a Trainer built in-process
checks it."""


def prepare_cpu_process(huge_pages_wanted: bool, mmap_threshold_mib: int | None, world_size: int) -> str:
    """Apply train.cpu_huge_pages and train.cpu_mmap_threshold_mib to this process, before the trainer's imports
    (torch.distributed.pipelining allocates a CPU tensor when imported); returns a line for the log."""
    global PREPARED
    huge_pages = ask_huge_pages() if huge_pages_wanted else False
    kernel_allows = THP_SWITCH.is_file() and "[never]" not in THP_SWITCH.read_text()
    if huge_pages_wanted and not huge_pages and kernel_allows and os.environ.get(THP_ENV) == "1":
        log.warning("torch had allocated a CPU tensor before train.cpu_huge_pages could apply: no huge pages")
    malloc = configure_host_malloc(mmap_threshold_mib, world_size)
    PREPARED = True
    return f"host memory: {malloc}; transparent huge pages {'on' if huge_pages else 'off'}"


def ask_huge_pages() -> bool:
    """Have torch ask for transparent huge pages for CPU tensors of 2 MiB or more; True where its allocator now
    does (not where the process allocated a CPU tensor before, where the kernel has them off, or where the
    environment sets THP_MEM_ALLOC_ENABLE otherwise)."""
    if not THP_SWITCH.is_file() or "[never]" in THP_SWITCH.read_text():
        return False
    import torch  # here: forge.config.validate reads this module's constants without torch

    os.environ.setdefault(THP_ENV, "1")
    # torch page-aligns such tensors when the switch took; three 64-byte aligned ones all land so by a 2^-18 chance
    probes = [torch.empty(THP_MIN_BYTES, dtype=torch.uint8) for _ in range(3)]
    return all(probe.data_ptr() % os.sysconf("SC_PAGESIZE") == 0 for probe in probes)


def configure_host_malloc(threshold_mib: int | None, world_size: int) -> str:
    """Apply train.cpu_mmap_threshold_mib (None: automatic, by world size); returns what was done, for the log."""
    if threshold_mib is None:
        if world_size == 1:
            return "heap kept" if keep_heap() else "glibc's own"
        threshold_mib = RANKS_THRESHOLD_MIB
    return f"mmap threshold {threshold_mib} MiB" if set_mmap_threshold(threshold_mib) else "glibc's own"


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where the C library is not glibc or the environment already tunes its malloc (the
    environment wins)."""
    if any(name in os.environ for name in ENVIRONMENT_KNOBS):
        return None
    if any(name in os.environ.get("GLIBC_TUNABLES", "") for name in TUNABLE_KNOBS):
        return None
    if platform.libc_ver()[0] != "glibc":  # musl and others: their own policy stands
        return None
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def keep_heap() -> bool:
    """Serve every allocation from the heap (no mmap) and never trim it; False where nothing changed."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # glibc still falls back to mmap when the heap cannot grow (sysmalloc's try_mmap ignores the count)
    done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    if not done:
        log.warning("the C library refused to keep freed memory in its heap; its default stands")
    return done


def set_mmap_threshold(mebibytes: int) -> bool:
    """Fix glibc's mmap threshold at `mebibytes` MiB; False when 0, when the environment already tunes malloc, or
    when the C library is not glibc (then nothing changes)."""
    mallopt = _mallopt() if mebibytes > 0 else None
    if mallopt is None:
        return False
    mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)  # an earlier job of a multirun in this process may have kept the heap
    done = bool(mallopt(M_MMAP_THRESHOLD, mebibytes << 20))
    if not done:
        log.warning("the C library refused an mmap threshold of %d MiB; its default stands", mebibytes)
    else:
        # a fixed threshold also fixes the heap's trim threshold at 128 KiB, and the heap would shrink and regrow at
        # every step (benchmarks/memory/malloc_step_time.py); glibc's own adaptive rule uses twice the threshold
        mallopt(M_TRIM_THRESHOLD, 2 * (mebibytes << 20))
    return done
