"""Name the rank that is dead or stalled, instead of every rank waiting in a collective until it times out.

A liveness round is a barrier on its own gloo group, with its own short timeout: every rank sends a token to
rank 0, which waits for all of them, then answers each rank that arrived with the list of ranks that did not.
Rank 0 therefore names the missing ranks; a rank whose answer never comes names rank 0. Rounds run
periodically from the loop (resilience.liveness_every_steps) and once after a collective failed, to say whom
the failure is about.
"""

import contextlib
import datetime
import logging
import re
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger("forge")

EXIT_PEER_LOST = 77

# Messages of gloo's transport when a peer is dead or silent (NCCL raises DistBackendError, a DistError).
_NETWORK_ERRORS = (
    "gloo/transport",
    "Timed out waiting",
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL communicator was aborted",  # under TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (forge.parallel.dist)
    "Watchdog caught collective operation timeout",
    "ncclRemoteError",
)


class PeerLostError(RuntimeError):
    """A peer rank is dead or stalled: it missed a liveness round, or a collective with it failed."""


def is_collective_failure(err: BaseException | None) -> bool:
    """True when err, or an exception it was raised from, comes from a failed or timed-out collective."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (PeerLostError, dist.DistError)):
            return True
        if any(fragment in str(err) for fragment in _NETWORK_ERRORS):
            return True
        err = err.__cause__ or err.__context__
    return False


def _post(start: Callable[..., dist.Work], *args, **kwargs) -> dist.Work | None:
    """Post a send or receive; None when the peer's connection is already gone (gloo raises at once then)."""
    try:
        return start(*args, **kwargs)
    except RuntimeError:
        return None


def _wait(work: dist.Work | None, timeout_s: float) -> bool:
    """Wait for a posted send or receive; False when it timed out, failed, or could not be posted."""
    if work is None:
        return False
    try:
        work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
    except RuntimeError:
        return False
    return True


class Liveness:
    """Liveness rounds over every rank on a dedicated gloo group (a no-op in a single process)."""

    def __init__(self, timeout_s: float, every_steps: int = 0):
        self.timeout_s = timeout_s
        self.every_steps = every_steps
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            timeout = datetime.timedelta(seconds=2 * timeout_s + 10)
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def missing_ranks(self) -> list[int]:
        """One round: the ranks that did not reach it within the timeout (empty when all did)."""
        if self.group is None:
            return []
        world = dist.get_world_size()
        if dist.get_rank() != 0:
            token = torch.ones(1, dtype=torch.int64)
            answer = torch.zeros(world, dtype=torch.int64)
            # Rank 0 may wait a full timeout for a late rank before it answers.
            if not _wait(_post(dist.isend, token, dst=0, group=self.group), 2 * self.timeout_s):
                return [0]
            if not _wait(_post(dist.irecv, answer, src=0, group=self.group), 2 * self.timeout_s):
                return [0]
            return answer.nonzero().flatten().tolist()
        tokens = {r: torch.zeros(1, dtype=torch.int64) for r in range(1, world)}
        receives = {r: _post(dist.irecv, tokens[r], src=r, group=self.group) for r in tokens}
        deadline = time.monotonic() + self.timeout_s
        missing = [r for r, work in receives.items() if not _wait(work, deadline - time.monotonic())]
        answer = torch.zeros(world, dtype=torch.int64)
        answer[missing] = 1
        for r in tokens:
            if r not in missing:
                _wait(_post(dist.isend, answer, dst=r, group=self.group), self.timeout_s)
        return missing

    def close(self) -> None:
        """Release the group (a no-op once the whole process group was torn down)."""
        if self.group is not None and dist.is_initialized():
            with contextlib.suppress(ValueError, RuntimeError):  # a group from an earlier, since replaced world
                dist.destroy_process_group(self.group)
        self.group = None

    def check(self, step: int) -> None:
        """Every liveness_every_steps steps: raise PeerLostError naming the ranks that missed this round."""
        if self.group is None or self.every_steps <= 0 or step % self.every_steps:
            return
        missing = self.missing_ranks()
        if missing:
            raise PeerLostError(
                f"liveness check at step {step}: {_ranks(missing)} did not reach it within {self.timeout_s:g} s "
                "(stalled or dead)" + _seen_from(missing)
            )

    def diagnose(self, err: BaseException, step: int | None) -> PeerLostError:
        """After a collective failed: one round to name the ranks it is about."""
        if isinstance(err, PeerLostError):
            return err
        reason = _short(err)
        missing = self.missing_ranks()
        where = f"at step {step}" if step is not None else "outside a step"
        if missing:
            who = f"{_ranks(missing)} did not answer a liveness check within {self.timeout_s:g} s (stalled or dead)"
            who += _seen_from(missing)
        else:
            who = "every rank answered a liveness check afterwards; a rank may have been slow or a link failed"
        return PeerLostError(f"a collective failed {where} ({reason}); {who}")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _seen_from(missing: list[int]) -> str:
    """Only rank 0 sees every rank; another rank that names rank 0 may itself have arrived late."""
    if dist.get_rank() != 0 and missing == [0]:
        return "; if rank 0 is alive, its log names the ranks it misses"
    return ""


def _short(err: BaseException) -> str:
    """The first line of an error, without gloo's source path and closing advice."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"\[[^\]]*/gloo/[^\]]*\] ", "gloo: ", text)
    return re.sub(r"\s*This is typically caused.*?GLHF![^\w(]*", " ", text).strip()
