"""Process-group setup and teardown: nccl on GPU, gloo on CPU; rank and rendezvous from torchrun or SLURM."""

import atexit
import contextlib
import datetime
import gc
import logging
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from forge.parallel.env import DistEnv, read_dist_env

log = logging.getLogger("forge")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device, env: DistEnv | None = None, timeout_s: float = 1800.0) -> bool:
    """Join the process group described by torchrun's or SLURM's environment.

    Returns True when this call created the group (so the caller owns its teardown); False for a single process
    or when the group already exists (a test harness or an outer program made it).
    """
    env = env or read_dist_env()
    if dist.is_initialized() or env.world_size == 1:
        return False
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    # SLURM sets no MASTER_* variables; env:// rendezvous needs them.
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    if backend_for(device) == "nccl":
        # 2 = abort the communicators and raise in Python (the default, 1, kills the process from NCCL's watchdog
        # thread), so a failed collective reaches forge.resilience.liveness: a line naming the rank, exit 77.
        # Not yet run on a multi-GPU machine.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend_for(device),
        store=attempt_store(env, timeout),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    atexit.register(_destroy_if_alive)
    log.debug("rank %d/%d joined the %s process group", env.rank, env.world_size, backend_for(device))
    return True


def attempt_store(env: DistEnv, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's agent, the agent's store with a prefix of its own per restart; elsewhere None (env://
    makes the store).

    torchrun's agent keeps one store server for every restart of its workers (its TCPStore sharing), and the store
    env:// connects to it adds no per-restart prefix. A restarted group then read the previous group's gloo
    addresses, which the new ranks had not yet replaced, and failed to connect ("Gloo connectFullMesh failed ...
    Connection refused") or hung, so torchrun's --max-restarts spent its restarts. The restart count names the
    attempt only where one agent counts it: with several nodes, an agent restarts its healthy workers without
    counting when another node waits, so nodes could wait under different prefixes. Several nodes therefore run
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the README's elastic commands): torch then starts a fresh store for
    each rendezvous round, and there is no agent store to prefix.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    client = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"forge/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def teardown() -> None:
    """Leave the process group without gloo's exit-time abort.

    A plain destroy_process_group() lets gloo's run-loop thread free pending work during interpreter shutdown,
    which aborts ~30% of 2-rank runs (pytorch/pytorch#190489); collecting garbage around a barrier and waiting
    briefly after the destroy cured it in 40/40 runs.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    time.sleep(0.2)


def _destroy_if_alive() -> None:
    # On an error path other ranks may never reach a barrier, so only destroy.
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main_process() -> bool:
    return rank() == 0


@contextlib.contextmanager
def local_rank_zero_first(env: DistEnv | None = None) -> Iterator[None]:
    """Run the body on each node's local rank 0 first (e.g. to fill a disk cache), then on the other ranks.

    One all-reduce instead of a barrier carries whether a local rank 0 failed, so the waiting ranks stop at once
    with an error naming that instead of sitting out the collective timeout.
    """
    env = env or read_dist_env()
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    first = env.local_rank == 0
    if distributed and not first and _all_ranks_flag(False):
        raise RuntimeError("a local rank 0 failed in the step every rank waits for (see its error above)")
    try:
        yield
    except BaseException:
        if distributed and first:
            _all_ranks_flag(True)
        raise
    if distributed and first:
        _all_ranks_flag(False)


def _all_ranks_flag(failed: bool) -> bool:
    """True when any rank passed True (an all-reduce on the default group)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor(int(failed), device=device)
    dist.all_reduce(flag)
    return bool(flag.item())


def shared_run_dir(run_dir: str) -> str:
    """Rank 0's run directory on every rank (each rank's Hydra may have picked a different time stamp)."""
    if not dist.is_initialized():
        return run_dir
    holder = [run_dir]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
