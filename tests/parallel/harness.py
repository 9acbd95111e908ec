"""A fork-based launcher of real gloo process groups on the CPU (far cheaper than torchrun per test).

The parent imports torch once and forks the ranks; each child gets torchrun's environment variables, so the
code under test finds its rank the same way it does under torchrun. Children leave through os._exit, which
also avoids gloo's exit-time abort.
"""

import faulthandler
import os
import socket
import traceback
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, queue, args: tuple) -> None:
    code = 0
    faulthandler.enable(all_threads=True)
    try:
        if world_size > 1:
            os.environ |= {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, fn(*args), None))
        if world_size > 1:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
        code = 1
    os._exit(code)


def launch(fn: Callable, world_size: int, *args, timeout: float = 300) -> list:
    """Run fn(*args) on `world_size` forked ranks in one process group; return each rank's result by rank."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, queue, args)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, object] = {}
    errors = []
    for proc in procs:
        proc.join(timeout)
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            proc.kill()
            errors.append(f"rank {rank} timed out after {timeout} s")
        elif proc.exitcode not in (0, 1):
            errors.append(f"rank {rank} ended with exit code {proc.exitcode} (a negative code is the signal)")
    while not queue.empty():
        rank, result, error = queue.get()
        if error:
            errors.append(f"rank {rank}:\n{error}")
        else:
            results[rank] = result
    if errors or len(results) != world_size:
        raise AssertionError("\n".join(errors) or f"only ranks {sorted(results)} reported")
    return [results[r] for r in range(world_size)]
