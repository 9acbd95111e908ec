"""One object the loop consults each step: preemption, non-finite values, the watchdog, fault injection."""

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from forge.config.schema import ResilienceConfig
from forge.resilience.flight_recorder import dump_line
from forge.resilience.hard_exit import hard_exit
from forge.resilience.liveness import EXIT_PEER_LOST, Liveness, PeerLostError, is_collective_failure
from forge.resilience.nonfinite import NonFiniteError, NonFinitePolicy, StepFlags
from forge.resilience.preemption import PreemptionHandler
from forge.resilience.progress import ProgressBoard
from forge.resilience.stragglers import StragglerClock, spin
from forge.resilience.watchdog import StepWatchdog

log = logging.getLogger("forge")


class RollbackRequested(Exception):
    """Raised inside a step under the rollback policy; the loop reloads the last good checkpoint."""

    def __init__(self, step: int):
        super().__init__(f"roll back from step {step}")
        self.step = step


class StepGuard:
    def __init__(
        self,
        cfg: ResilienceConfig,
        preemption: PreemptionHandler | None = None,
        run_dir: Path | None = None,
        stage_groups: list[list[int]] | None = None,
    ):
        """`preemption`: a handler installed earlier (the trainer installs it first, so a signal during a long
        start-up still ends in a checkpoint and a requeue). `run_dir`: where a rank that ends the job writes its
        flight recorder. `stage_groups`: the ranks whose busy times are compared (forge.parallel.mesh.stage_groups;
        None: every rank)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.preemption = preemption or PreemptionHandler(list(cfg.preemption_signals), cfg.preemption_deadline_s)
        self.nonfinite = NonFinitePolicy(cfg.nonfinite_policy, cfg.max_rollbacks)
        self.progress = ProgressBoard()
        self.watchdog = None
        if cfg.watchdog_factor > 0:
            self.watchdog = StepWatchdog(cfg.watchdog_factor, cfg.watchdog_min_s, peers=self.progress.report,
                                         on_fire=self.log_flight_recorder)  # fmt: skip
        self.liveness = Liveness(cfg.liveness_timeout_s, cfg.liveness_every_steps)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.stragglers = StragglerClock(cfg.straggler_factor, rank, stage_groups or [list(range(world))])
        self.bad_steps: set[int] = set()
        self.pending: list[StepFlags] = []  # launched steps' flags the host has not read yet, oldest first
        self.step: int | None = None  # the step in progress, for error messages

    def loss_for(self, step: int, loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`step`'s training loss: `loss` itself, or at resilience.inject_nan_at_step (a test hook) its value
        turned into NaN."""
        if step != self.cfg.inject_nan_at_step:
            return loss
        return lambda *args, **kwargs: loss(*args, **kwargs) * float("nan")

    def before_step(self, step: int) -> bool:
        """Start `step` (the watchdog's clock, the liveness check). True when its batches are to be skipped, a step
        rolled back for non-finite values: the last trained step's check is read first (it may roll back too)."""
        self.step_started(step)
        if step not in self.bad_steps:
            return False
        self.settle()
        return True

    def after_step(self, step: int, reads_host: bool, device: torch.device) -> bool:
        """After `step`'s update: its check is read when the host waits anyway (`reads_host`: a log line, an
        evaluation, a checkpoint), so the policy acts before them; returns whether the run stops (a signal on any
        rank; then the check is read, so the checkpoint holds no unread step)."""
        if reads_host:
            self.settle()
        stop = self.should_stop(device)
        if stop:
            self.settle()
        self.step_finished()
        return stop

    def _inject_slowness(self) -> None:
        """Test hook (resilience.inject_slow_rank, inject_slow_s): this rank works longer in every step."""
        if self.cfg.inject_slow_s and self.cfg.inject_slow_rank == (dist.get_rank() if dist.is_initialized() else 0):
            spin(self.cfg.inject_slow_s)

    def _inject_stall(self, step: int) -> None:
        """Test hook (resilience.inject_stall_at_step, inject_stall_rank): this rank hangs before the step."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        if step == self.cfg.inject_stall_at_step and self.cfg.inject_stall_rank in (None, rank):
            log.warning("fault injection: rank %d stalls at step %d", rank, step)
            time.sleep(3600)

    def launch_check(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        tokens: torch.Tensor | None = None,
        log_step: bool = False,
    ) -> StepFlags:
        """Start `step`'s check: its flags' all-reduce (non-finite values, a stop signal, with `tokens` this rank's
        labelled tokens, their sum over every rank, and on a `log_step` every rank's busy time), without a host
        sync. `settle` reads it."""
        self._inject_slowness()
        self.stragglers.step_done()
        busy = self.stragglers.share(loss.device) if log_step else None
        flags = StepFlags(step, loss, grad_norm, self.preemption.received is not None, tokens, busy)
        self.pending.append(flags)
        return flags

    def settle(self, keep_newest: bool = False) -> bool:
        """Read the pending steps' flags, oldest first (all but the newest with `keep_newest`), and apply the policy
        to each. Returns False when the last step read must not step its optimizer (skip policy); raise and
        rollback raise here. Every rank also learns whether any rank was signalled to stop: `should_stop` then
        costs nothing."""
        finite = True
        while len(self.pending) > int(keep_newest):
            flags = self.pending.pop(0)
            bad, stop = flags.read()
            if flags.busy_us:
                self.stragglers.observe(flags.busy_us)
            self.preemption.agreed = bool(self.preemption.agreed) or stop
            finite = not bad or self._nonfinite(flags)
        return finite

    def update_mask(self, flags: StepFlags) -> torch.Tensor | None:
        """Under a policy that never applies a non-finite step's update (skip, raise, rollback): 1.0 on the device
        when `flags`' step is finite, else 0.0, for an optimizer step that `settle` has not read yet; None under
        warn, which applies it."""
        return None if self.nonfinite.policy == "warn" else flags.finite()

    def should_stop(self, device: torch.device) -> bool:
        """True on every rank once any rank was signalled (`preemption.should_stop`). While a step's flags are
        unread they carry this rank's signal to the others: on several ranks the answer then waits for `settle`
        rather than taking an all-reduce and a host sync of its own."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self.preemption.agreed = None
            return self.preemption.received is not None  # one process: its own signal, at once
        if self.pending and self.preemption.agreed is None:
            return False
        return self.preemption.should_stop(device)

    def _nonfinite(self, flags: StepFlags) -> bool:
        """The policy for a step whose flags say non-finite: False for skip, True for warn; raise and rollback
        raise."""
        policy, step = self.nonfinite, flags.step
        message = policy.describe(step, flags.loss, flags.grad_norm)
        if policy.policy == "raise":
            raise NonFiniteError(message + " (resilience.nonfinite_policy=raise)")
        if policy.policy == "rollback":
            if policy.rollbacks >= policy.max_rollbacks:
                raise NonFiniteError(message + f"; {policy.max_rollbacks} rollbacks spent")
            policy.rollbacks += 1
            self.bad_steps.add(step)
            self.pending.clear()  # later steps are rolled back too
            log.warning("%s: rolling back to the last checkpoint and skipping this step's batches", message)
            raise RollbackRequested(step)
        if policy.policy == "skip":
            policy.skipped += 1
            log.warning("%s: optimizer step skipped (%d skipped so far)", message, policy.skipped)
            return False
        log.warning("%s: continuing (resilience.nonfinite_policy=warn)", message)
        return True

    def step_started(self, step: int | None = None) -> None:
        """Start the watchdog's clock for `step`, then run the periodic liveness check when one is due."""
        self.step = step
        if self.watchdog:
            self.watchdog.step_started(step)
        if step is not None:
            self.stragglers.step_started()
            self._inject_stall(step)
            self.progress.started(step)
            self.liveness.check(step)

    def step_finished(self) -> None:
        if self.watchdog:
            self.watchdog.step_finished()

    def exit_if_peer_lost(self, err: BaseException) -> None:
        """A failed collective or liveness check ends the job with one error naming the lost ranks (exit 77).

        The process leaves through hard_exit (os._exit after the registered callbacks): tearing down a process
        group whose peer is gone can hang or abort.
        Any other error, and any error of a single process, returns for the caller to re-raise.
        """
        if self.liveness.group is None or not is_collective_failure(err):
            return
        try:
            lost = self.liveness.diagnose(err, self.step)
        except Exception as probe_err:  # noqa: BLE001 - still end with the original failure
            lost = PeerLostError(f"a collective failed at step {self.step} ({err}); the liveness check failed too")
            lost.__cause__ = probe_err
        self._exit_peer_lost(lost)

    def _exit_peer_lost(self, err: Exception) -> NoReturn:
        rank = dist.get_rank() if dist.is_initialized() else 0
        log.error("rank %d: %s; ending the job (exit code %d)", rank, err, EXIT_PEER_LOST)
        self.log_flight_recorder()
        hard_exit(EXIT_PEER_LOST)

    def log_flight_recorder(self) -> None:
        """After the error line: this rank's recorded collectives written to the run directory, and where."""
        line = dump_line(self.run_dir, dist.get_rank() if dist.is_initialized() else 0)
        if line:
            log.error("%s", line)

    def metrics(self) -> dict:
        return {
            "skipped_steps": self.nonfinite.skipped,
            "rollbacks": self.nonfinite.rollbacks,
            **self.stragglers.metrics(),
        }

    def close(self) -> None:
        if self.watchdog:
            self.watchdog.stop()
        self.progress.close()
        self.preemption.restore()
        self.liveness.close()
