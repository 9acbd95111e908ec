"""One object the loop consults each step: preemption, non-finite values, the watchdog, fault injection."""

import logging
import time

import torch

from forge.resilience.nonfinite import NonFiniteError, NonFinitePolicy
from forge.resilience.preemption import PreemptionHandler
from forge.resilience.watchdog import StepWatchdog

log = logging.getLogger("forge")


class RollbackRequested(Exception):
    """Raised inside a step under the rollback policy; the loop reloads the last good checkpoint."""

    def __init__(self, step: int):
        super().__init__(f"roll back from step {step}")
        self.step = step


class StepGuard:
    def __init__(self, cfg):
        self.cfg = cfg
        self.preemption = PreemptionHandler(list(cfg.preemption_signals), cfg.preemption_deadline_s)
        self.nonfinite = NonFinitePolicy(cfg.nonfinite_policy, cfg.max_rollbacks)
        self.watchdog = StepWatchdog(cfg.watchdog_factor, cfg.watchdog_min_s) if cfg.watchdog_factor > 0 else None
        self.bad_steps: set[int] = set()

    def inject(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Test hook (resilience.inject_nan_at_step): turn one step's loss into NaN."""
        if step == self.cfg.inject_nan_at_step:
            return loss * float("nan")
        if step == self.cfg.inject_stall_at_step:
            time.sleep(3600)
        return loss

    def step_is_finite(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Apply the policy; False means: do not step the optimizer."""
        if not NonFinitePolicy.is_bad(loss, grad_norm):
            return True
        policy = self.nonfinite
        message = policy.describe(step, loss, grad_norm)
        if policy.policy == "raise":
            raise NonFiniteError(message + " (resilience.nonfinite_policy=raise)")
        if policy.policy == "rollback":
            if policy.rollbacks >= policy.max_rollbacks:
                raise NonFiniteError(message + f"; {policy.max_rollbacks} rollbacks spent")
            policy.rollbacks += 1
            self.bad_steps.add(step)
            log.warning("%s: rolling back to the last checkpoint and skipping this step's batches", message)
            raise RollbackRequested(step)
        if policy.policy == "skip":
            policy.skipped += 1
            log.warning("%s: optimizer step skipped (%d skipped so far)", message, policy.skipped)
            return False
        log.warning("%s: continuing (resilience.nonfinite_policy=warn)", message)
        return True

    def step_started(self) -> None:
        if self.watchdog:
            self.watchdog.step_started()

    def step_finished(self) -> None:
        if self.watchdog:
            self.watchdog.step_finished()

    def metrics(self) -> dict:
        return {"skipped_steps": self.nonfinite.skipped, "rollbacks": self.nonfinite.rollbacks}

    def close(self) -> None:
        if self.watchdog:
            self.watchdog.stop()
        self.preemption.restore()
