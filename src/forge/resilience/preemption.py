"""Stop cleanly when SLURM, submitit or a user sends SIGTERM / SIGUSR1 / SIGUSR2, or presses Ctrl-C (SIGINT).

The handler only sets a flag. In each step every rank learns whether any rank was signalled (a MAX all-reduce,
shared with the non-finite check), so all stop after the same step, checkpoint, and exit with EXIT_PREEMPTED,
which a launcher can requeue on (Ctrl-C: EXIT_INTERRUPTED, no requeue; a second Ctrl-C stops at once). A hard
deadline ends the process anyway if the final save hangs.
"""

import logging
import signal
import threading

import torch
import torch.distributed as dist

from forge.resilience.hard_exit import hard_exit

log = logging.getLogger("forge")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later" — requeue me
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C: the user stopped it, do not requeue


class PreemptionHandler:
    def __init__(self, signals: list[str], deadline_s: float):
        self.deadline_s = deadline_s
        self.received: str | None = None
        self.agreed: bool | None = None  # this step's agreement of every rank, when the step guard made one
        self._previous = {}
        for name in signals:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        if self.received is None:
            self.received = signal.Signals(signum).name
            timer = threading.Timer(self.deadline_s, self._hard_exit)
            timer.daemon = True
            timer.start()

    def _hard_exit(self) -> None:
        log.error("preemption: the final checkpoint did not finish within %.0f s; exiting anyway", self.deadline_s)
        hard_exit(EXIT_PREEMPTED)

    def should_stop(self, device: torch.device) -> bool:
        """True on every rank once any rank was signalled: the flag the step's all-reduce agreed on (`agreed`,
        set by the step guard), else an all-reduce of its own."""
        if self.agreed is not None:
            flag, self.agreed = self.agreed, None
            return flag
        flag = self.received is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            tensor = torch.tensor([1 if flag else 0], device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            flag = bool(tensor.item())
        return flag

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
