"""Rank, world size and rendezvous address from torchrun's environment or SLURM's."""

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as 'gpu[003-005,010],cpu1' -> 'gpu003'."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def read_dist_env(environ: dict[str, str] | None = None) -> DistEnv:
    """torchrun's variables win; else SLURM's (one task per process); else a single process."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env and "RANK" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=int(env["SLURM_NTASKS"]),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT", 20000 + job_id % 20000)),
        )
    return DistEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=29500)
