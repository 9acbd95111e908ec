"""`forge-train --calibrate`: measure the machine a run is on and write a device profile the search can read
(`search.profile=<file>`) in place of the device table, so that on a cluster the search predicts that cluster.

Run it the way training runs (`torchrun --nproc_per_node=N -m forge.train --calibrate`, or a SLURM job): each rank
times square matmuls in fp32 and bf16 on its device, and the ranks time the collectives the plan uses (all-gather,
reduce-scatter, all-reduce, all-to-all) on the whole group, 16 MiB per rank, best of a few. A bandwidth is the
bytes one rank sends in a ring ((n - 1) / n of a gathered or scattered buffer, twice that for an all-reduce) over
the seconds. The slowest collective's rate is the profile's link: intra-node when every rank is on one node, and
then the inter-node rate is unknown and taken equal to it (the profile says so). A collective's fixed cost is the
median time of a one-element all-reduce right after every rank computed: the launch and the wait for the slowest
peer, which set the time of the many small collectives of tensor parallelism and pipelines (on a CPU host whose
ranks share cores, the scheduler's time slice: milliseconds, not a GPU's microseconds).
"""

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from forge.planning.peak import device_name, matmul_size_for, measure_matmul_flops

PROFILE = "device_profile.json"
BUFFER_BYTES = 16 * 2**20
"""Bytes per rank of each timed collective: large enough that bandwidth, not latency, sets the time."""


def _synchronizer(device: torch.device):
    """Waits for the device's queued work (a no-op on a CPU, whose collectives return when done)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _best_seconds(run, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_collectives(device: torch.device) -> dict[str, float]:
    """Bytes/s one rank sends in each collective on the default group (empty for one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    n = dist.get_world_size()
    elems = BUFFER_BYTES // 4 // n * n
    full = torch.ones(elems, device=device)
    shard = torch.ones(elems // n, device=device)
    sync = _synchronizer(device)

    def timed(op) -> float:
        def run() -> None:
            op()
            sync()

        run()  # warm-up: connections and buffers
        return _best_seconds(run)

    share = (n - 1) / n
    seconds = {
        "all_gather": (timed(lambda: dist.all_gather_into_tensor(full, shard)), share * full.nbytes),
        "reduce_scatter": (timed(lambda: dist.reduce_scatter_tensor(shard, full)), share * full.nbytes),
        "all_reduce": (timed(lambda: dist.all_reduce(full)), 2 * share * full.nbytes),
        "all_to_all": (timed(lambda: dist.all_to_all_single(torch.empty_like(full), full)), share * full.nbytes),
    }
    return {name: nbytes / max(t, 1e-9) for name, (t, nbytes) in seconds.items()}


BURST_S = 0.05
"""Compute before each timed small collective: long enough that a rank sharing its core is preempted in it."""


def measure_latency(device: torch.device, fp32_flops: float, reps: int = 20) -> float | None:
    """Median seconds of a one-element all-reduce on the default group, each right after every rank did ~BURST_S of
    matmuls, the slowest rank's (None for one process). Timed after its own compute, as a training step's collectives
    are, it holds the launch and the wait for the slowest peer; on a CPU host whose ranks share cores that wait
    is the scheduler's time slice, far above an idle all-reduce."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    size = 512 if device.type == "cpu" else 4096
    a = torch.randn(size, size, device=device)
    products = max(1, round(BURST_S * fp32_flops / (2 * size**3)))
    one = torch.zeros(1, device=device)
    sync = _synchronizer(device)
    dist.all_reduce(one)
    sync()
    seconds = []
    for _ in range(reps):
        for _ in range(products):
            a @ a
        sync()
        start = time.perf_counter()
        dist.all_reduce(one)
        sync()
        seconds.append(time.perf_counter() - start)
    # a rank that tends to arrive last hardly waits: the profile keeps the slowest rank's median
    median = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def device_memory_gib(device: torch.device, local_ranks: int) -> float:
    """The device's memory; on a CPU, the host's divided among the ranks on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20 / max(local_ranks, 1)
    raise OSError("no MemTotal in /proc/meminfo")


def calibrate(device: torch.device, local_ranks: int, nodes: int) -> dict:
    """This machine's profile (every rank calls it: the collectives are timed together)."""
    peaks = {dtype: measure_matmul_flops(device, dtype, matmul_size_for(device, dtype), seconds=0.5)
             for dtype in ("fp32", "bf16")}  # fmt: skip
    collectives = measure_collectives(device)
    link = min(collectives.values()) if collectives else None
    latency = measure_latency(device, peaks["fp32"])
    return {
        "name": device_name(device),
        "peak_flops": peaks,
        "memory_gib": device_memory_gib(device, local_ranks),
        "collectives_bytes_per_s": collectives,
        "intra_node": link if nodes == 1 else None,
        "inter_node": link,
        "inter_node_measured": nodes > 1,
        "collective_latency_s": latency,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "threads": torch.get_num_threads(),
        "shares_cores": device.type == "cpu" and local_ranks * torch.get_num_threads() > available_cores(),
    }


def available_cores() -> int:
    """The host's CPU cores (not this rank's affinity mask: a launcher that binds each rank to its own cores gives
    each a slice, and the ranks together still have them all)."""
    return os.cpu_count() or 1


def write_profile(profile: dict, folder: Path) -> Path:
    path = folder / PROFILE
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(path)
    return path


def run_calibration(device: torch.device, run_dir: Path) -> Path | None:
    """Join the process group of torchrun's or SLURM's environment, measure, and write the profile in `run_dir`
    (rank 0); returns its path on rank 0."""
    from forge.parallel.dist import init_distributed, teardown
    from forge.parallel.env import read_dist_env

    env = read_dist_env()
    owns = init_distributed(device, env)
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or env.world_size)
        nodes = max(env.world_size // max(local, 1), 1)
        profile = calibrate(device, local, nodes)
        if env.rank != 0:
            return None
        path = write_profile(profile, run_dir)
        links = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in profile["collectives_bytes_per_s"].items())
        peaks = ", ".join(f"{k} {v / 1e12:.3f} TFLOP/s" for k, v in profile["peak_flops"].items())
        latency = f"; a collective's latency {profile['collective_latency_s'] * 1e6:,.0f} us" if links else ""
        print(f"device profile: {path}\n  {profile['name']}: {peaks}; {profile['memory_gib']:.1f} GiB"
              f"\n  {profile['world_size']} ranks: {links or 'one process, no collectives'}{latency}"
              f"\n  use it: forge-train --plan --search search.profile={path}", flush=True)  # fmt: skip
        return path
    finally:
        if owns:
            teardown()
