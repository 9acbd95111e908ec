"""glibc's malloc when the training device is the CPU: where freed tensors go.

glibc serves a large allocation with mmap and returns it to the OS when freed, but each such free raises its
threshold (up to 32 MiB), so the next allocations of that size come from the heap and stay there once freed. A
FSDP rank gathers, frees and regathers each block's parameters (tens of MiB at llama_125m); held in the heap, they
fragment it and the rank's resident memory grows by what it freed, measured at +0.8 GiB of 2.3 GiB on 4 ranks
(benchmarks/memory/host_peak.py). A fixed threshold sends tensors of at least that size back to the OS at once.
"""

import ctypes
import logging
import os
import platform

log = logging.getLogger("forge")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MAX_THRESHOLD_MIB = 32  # glibc refuses more on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
ENV = "MALLOC_MMAP_THRESHOLD_"


def set_mmap_threshold(mebibytes: int) -> bool:
    """Fix glibc's mmap threshold at `mebibytes` MiB; False when 0, when the environment already sets it (ENV or
    GLIBC_TUNABLES), or when the C library is not glibc (then nothing changes)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if mebibytes <= 0 or ENV in os.environ or "glibc.malloc.mmap_threshold" in tunables:
        return False
    if platform.libc_ver()[0] != "glibc":  # musl and others: their own policy stands
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, mebibytes << 20))
    if not done:
        log.warning("the C library refused an mmap threshold of %d MiB; its default stands", mebibytes)
    elif "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        # a fixed threshold also fixes the heap's trim threshold at 128 KiB, and shrinking and regrowing the heap
        # at every step cost a tiny model's 2-rank step 13 %; glibc's own adaptive rule uses twice the threshold
        mallopt(M_TRIM_THRESHOLD, 2 * (mebibytes << 20))
    return done
