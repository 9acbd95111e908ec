"""Replica groups that step on while one of them is lost (resilience.fault_tolerance=torchft).

Each replica group is a job of its own (a torchrun job with the usual layout over its ranks). torchft's lighthouse
forms a quorum of the live groups before each step; after the backward the same rank of every group averages its
gradients with its peers over torchft's process group, and the step commits only where that worked. A group that
dies is left out of the next quorum and the others go on; when it restarts (torchrun's --max-restarts), its first
quorum finds it behind, and torchft copies a live group's state into it over HTTP: the weights, the optimizer, the
schedule, the data position and the step, as this rank's local shards (the groups share one layout, so rank r's
shards are the same slices everywhere).

A restarted group first resumes from its own latest checkpoint, as any run; the quorum then finds it behind the
live groups and it takes their state. With every group gone, each resumes from its own checkpoints and the groups
that are behind take the state of the one furthest ahead at the first quorum.
"""

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge.config.schema import ResilienceConfig

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
        return local(tree).detach().to("cpu", copy=True)
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
    and whether the step commits. torchft's step counts committed steps, as the trainer's does: a dropped step is
    trained again (with the next batches), so a group behind the others, a restarted one or one resumed from an
    older checkpoint, is the one healed."""

    def __init__(
        self, cfg: ResilienceConfig, device: torch.device, state: Callable[[], dict], load: Callable[[dict], None]
    ):
        """`cfg`: the resilience config. `state` / `load`: this rank's state as local shards, and its loading (what
        a live group sends a restarted one). The group joins at its first step (`start_step`): its first
        evaluation and its start-up do not hold the other groups' quorum."""
        try:
            import torchft  # noqa: F401
        except ImportError as err:
            raise RuntimeError(
                f"resilience.fault_tolerance=torchft needs torchft (pip install 'forge-train[ft]'): {err}"
            ) from err
        self.lighthouse = cfg.ft_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not self.lighthouse:
            raise RuntimeError(
                "resilience.fault_tolerance=torchft needs a lighthouse: set resilience.ft_lighthouse or "
                "TORCHFT_LIGHTHOUSE (forge.launch.replica_groups starts one)"
            )
        self.cfg, self.device, self.state, self.load = cfg, device, state, load
        self.manager = None
        self.committed = True  # the last step's
        self.dropped = 0  # steps whose update was dropped (a peer group was lost during them)

    def _join(self, step: int) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        cfg = self.cfg
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)  # its INFO lines come every step
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        timeout = datetime.timedelta(seconds=cfg.ft_timeout_s)
        host, port, self.store = _group_store(rank)
        pg = ProcessGroupNCCL(timeout=timeout) if self.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=self.load,
            state_dict=self.state,
            min_replica_size=cfg.ft_min_replicas,
            use_async_quorum=False,  # a restarted group loads its peer's state before its first step
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=rank,
            world_size=world,
            store_addr=host,
            store_port=port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"forge_{cfg.ft_replica_id}",
            init_sync=False,  # every group starts from the same seeded weights
        )
        self.manager.load_state_dict({"step": step, "batches_committed": 0})  # a resumed group's step

    def start_step(self, step: int) -> None:
        """The quorum of live groups before the step after `step` (the last committed one); a group that is behind
        loads a live group's state here. In a group of several ranks, a rank whose quorum failed (its state may not
        have loaded while its peers' did) ends the group, which torchrun restarts: the group must not go on split.
        A group of one rank goes on, and the next quorum tries again."""
        if self.manager is None:
            self._join(step)
            self._wait_for_every_group()
        else:
            self.manager.start_quorum()
        error = self.manager.errored()
        if error is not None and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(f"replica group {self.cfg.ft_replica_id}: its quorum failed: {error.original_exception}")

    def _wait_for_every_group(self) -> None:
        """The first quorum, asked again until every group is in it or ft_join_timeout_s has passed: a group that
        starts alone would otherwise train alone until the others' first quorum, and groups resumed at different
        steps would meet only after training apart."""
        deadline = time.monotonic() + self.cfg.ft_join_timeout_s
        self.manager.start_quorum()
        if self.manager.num_participants() < self.cfg.ft_replicas:
            log.info(
                "replica group %d: %d of %d groups in its first quorum; waiting up to %g s for the others",
                self.cfg.ft_replica_id,
                self.manager.num_participants(),
                self.cfg.ft_replicas,
                self.cfg.ft_join_timeout_s,
            )
        while self.manager.num_participants() < self.cfg.ft_replicas and time.monotonic() < deadline:
            time.sleep(0.1)
            self.manager.start_quorum()
        if self.manager.num_participants() < self.cfg.ft_replicas:
            log.warning(
                "replica group %d: %d of %d groups joined within %g s; training with those",
                self.cfg.ft_replica_id,
                self.manager.num_participants(),
                self.cfg.ft_replicas,
                self.cfg.ft_join_timeout_s,
            )

    def average_gradients(self, model: torch.nn.Module) -> None:
        """Average this rank's gradient shards with the same rank of every group in the quorum (one all-reduce per
        dtype; a parameter without a gradient here counts as zeros, as it may have one in another group). A lost
        peer fails it quietly: the gradients are zeroed (torchft leaves them undefined) and `commit` says no."""
        grads: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in model.parameters():
            if param.requires_grad:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = local(param.grad)
                grads.setdefault(grad.dtype, []).append(grad)
        for same_dtype in grads.values():
            flat = torch.cat([grad.reshape(-1) for grad in same_dtype])
            self.manager.allreduce(flat).wait()
            if self.manager.errored() is not None:
                torch._foreach_zero_(same_dtype)
                continue
            parts = flat.split([grad.numel() for grad in same_dtype])
            torch._foreach_copy_(same_dtype, [part.view_as(grad) for part, grad in zip(parts, same_dtype)])

    def commit(self, step: int) -> bool:
        """Whether `step`'s update is applied: on every rank of this group alike, False when a collective with a
        peer group failed or fewer than ft_min_replicas groups took part (the step is then trained again)."""
        self.committed = self.manager.should_commit()
        if not self.committed:
            self.dropped += 1
            log.warning(
                "replica group %d: step %d's update is dropped (a peer group was lost, or fewer than the minimum "
                "took part); the step is trained again with the next batches",
                self.cfg.ft_replica_id,
                step,
            )
        return self.committed

    def metrics(self) -> dict:
        return {"replica_groups": self.manager.num_participants(), "dropped_steps": self.dropped}

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
