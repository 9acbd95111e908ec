"""Memory of the training process: CUDA allocator statistics on a GPU, the process RSS on a CPU."""

import resource
from collections.abc import Iterable
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
    """The highest sum of live tensor bytes over a `profile(profile_memory=True)` window: the allocation (+) and free
    (-) events torch's CPU allocator reports, the CPU counterpart of max_memory_allocated. Unlike the RSS it leaves
    out glibc's retained heap, so it is the same on every machine."""
    from torch._C._profiler import _EventType

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    # on a tie a free goes first: an address is freed before it is handed out again
    allocations = sorted(
        (e for e in walk(tree) if e.tag == _EventType.Allocation),
        key=lambda e: (e.start_time_ns, e.extra_fields.alloc_size > 0),
    )
    return peak_of_allocations((e.extra_fields.ptr, e.extra_fields.alloc_size) for e in allocations)


def peak_of_allocations(events: Iterable[tuple[int, int]]) -> int:
    """The highest sum of live bytes over (address, +bytes allocated or -bytes freed) events in time order.

    Tensors are followed by address, not summed blindly: a free made on a thread the profiler does not follow (a
    collective's buffer released by gloo's worker, as TP and pipeline sends do) is never reported, and a running
    sum would count that tensor live to the end. An allocation at an address still live therefore retires the
    tensor that held it; a free of an address allocated before the window is left out. A tensor freed unseen whose
    memory is handed out again at other start addresses stays counted."""
    live: dict[int, int] = {}
    total = peak = 0
    for ptr, nbytes in events:
        total -= live.pop(ptr, 0)
        if nbytes > 0:
            live[ptr] = nbytes
            total += nbytes
        peak = max(peak, total)
    return peak
