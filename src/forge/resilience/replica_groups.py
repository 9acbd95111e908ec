"""Replica groups that step on while one of them is lost (resilience.fault_tolerance=torchft).

Each replica group is a job of its own (a torchrun job with the usual layout over its ranks). torchft's lighthouse
forms a quorum of the live groups before each step; after the backward the same rank of every group averages its
gradients with its peers over torchft's process group, and the step commits only where that worked. A group that
dies is left out of the next quorum and the others go on; when it restarts (torchrun's --max-restarts), its first
quorum finds it behind, and torchft copies a live group's state into it over HTTP: the weights, the optimizer, the
schedule, the data position and the step, as this rank's local shards (the groups share one layout, so rank r's
shards are the same slices everywhere).

Only the restart is on disk: the state comes from a peer. With every group gone, the run resumes from its
checkpoints as any other run.
"""

import datetime
import logging
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger("forge")


def local(value):
    """A DTensor's local shard; anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def local_tree(tree):
    """`tree` (dicts, lists, tensors) with every DTensor replaced by its local shard, tensors detached on the CPU."""
    if isinstance(tree, dict):
        return {key: local_tree(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_tree(value) for value in tree)
    if isinstance(tree, torch.Tensor):
        return local(tree).detach().cpu().clone()
    return tree


def load_model_shards(model: torch.nn.Module, shards: dict) -> None:
    """Copy each received local shard into the model's own, in place."""
    with torch.no_grad():
        for name, value in model.state_dict().items():
            local(value).copy_(shards[name])


def load_optimizer_shards(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load an optimizer state of local shards: a tensor shaped as its parameter's shard becomes a DTensor laid out
    as the parameter (the optimizer's own state may be empty: a restarted group has not stepped yet)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in state["state"].items():
        param = params[index]
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue
            if isinstance(param, DTensor) and value.shape == param.to_local().shape and value.dim() > 0:
                entries[key] = DTensor.from_local(
                    value.to(param.device), param.device_mesh, param.placements, run_check=False,
                    shape=param.shape, stride=param.stride(),
                )  # fmt: skip
            elif value.dim() > 0:
                entries[key] = value.to(param.device)
    optimizer.load_state_dict(state)


def _group_store(group_rank: int) -> tuple[str, int, dist.TCPStore | None]:
    """A store of this group's own for torchft (host, port; rank 0 serves it): torchrun's store outlives a
    restarted attempt and would hand it the last attempt's manager address."""
    server = None
    address = [None]
    if group_rank == 0:
        server = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        address = [(socket.gethostname(), server.port)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(address, src=0)
    host, port = address[0]
    return host, port, server


class ReplicaGroups:
    """This rank's part in the replica groups: a quorum before each step, the gradients averaged across groups,
    and whether the step commits."""

    def __init__(self, cfg, device: torch.device, state: Callable[[], dict], load: Callable[[dict], None]):
        """`cfg`: the resilience config. `state` / `load`: this rank's state as local shards, and its loading (what
        a live group sends a restarted one)."""
        try:
            from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        except ImportError as err:
            raise RuntimeError(
                f"resilience.fault_tolerance=torchft needs torchft (pip install 'forge-train[ft]'): {err}"
            ) from err
        lighthouse = cfg.ft_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise RuntimeError(
                "resilience.fault_tolerance=torchft needs a lighthouse: set resilience.ft_lighthouse or "
                "TORCHFT_LIGHTHOUSE (forge.launch.replica_groups starts one)"
            )
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)  # its INFO lines come every step
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        timeout = datetime.timedelta(seconds=cfg.ft_timeout_s)
        host, port, self.store = _group_store(rank)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.replica_id = cfg.ft_replica_id
        self.manager = Manager(
            pg=pg,
            load_state_dict=load,
            state_dict=state,
            min_replica_size=cfg.ft_min_replicas,
            use_async_quorum=False,  # a restarted group loads its peer's state before its first step
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=rank,
            world_size=world,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse,
            replica_id=f"forge_{cfg.ft_replica_id}",
            init_sync=False,  # every group starts from the same seeded weights
        )
        self.dropped = 0  # steps whose update was dropped (a peer group was lost during them)

    def start_step(self) -> None:
        """The quorum of live groups for the next step; a group that is behind loads a live group's state here."""
        self.manager.start_quorum()

    def average_gradients(self, model: torch.nn.Module) -> None:
        """Average this rank's gradient shards with the same rank of every group in the quorum (one all-reduce per
        dtype). A lost peer fails it quietly: `commit` then says no."""
        grads: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in model.parameters():
            if param.grad is not None:
                grad = local(param.grad)
                grads.setdefault(grad.dtype, []).append(grad)
        for same_dtype in grads.values():
            flat = torch.cat([grad.reshape(-1) for grad in same_dtype])
            self.manager.allreduce(flat).wait()
            parts = flat.split([grad.numel() for grad in same_dtype])
            torch._foreach_copy_(same_dtype, [part.view_as(grad) for part, grad in zip(parts, same_dtype)])

    def commit(self, step: int) -> bool:
        """Whether `step`'s update is applied: on every rank of this group alike, False when a collective with a
        peer group failed or fewer than ft_min_replicas groups took part."""
        if self.manager.should_commit():
            return True
        self.dropped += 1
        log.warning(
            "replica group %d: step %d's update is dropped (a peer group was lost, or fewer than the minimum took "
            "part); the next quorum goes on without it",
            self.replica_id,
            step,
        )
        return False

    def metrics(self) -> dict:
        return {"replica_groups": self.manager.num_participants(), "dropped_steps": self.dropped}

    def close(self) -> None:
        self.manager.shutdown(wait=False)
