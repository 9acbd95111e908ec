"""Memory of the training process: CUDA allocator statistics on a GPU, the process RSS on a CPU."""

import resource
from pathlib import Path

import torch

GIB = 2**30


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; the peak elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def memory_metrics(device: torch.device) -> dict[str, float]:
    """GiB: mem_allocated / mem_peak / mem_reserved on CUDA; mem_rss / mem_rss_peak otherwise."""
    if device.type == "cuda":
        return {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        }
    return {"mem_rss_gib": rss_bytes() / GIB, "mem_rss_peak_gib": peak_rss_bytes() / GIB}


def peak_live_tensor_bytes(prof: torch.profiler.profile) -> int:
    """The highest sum of live tensor bytes over a `profile(profile_memory=True)` window: the running sum of the
    allocation (+) and free (-) events torch's CPU allocator reports, the CPU counterpart of max_memory_allocated.
    Unlike the RSS it leaves out glibc's retained heap, so it is the same on every machine."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
