"""Resilience: preemption signals, the non-finite loss policy and the step watchdog."""

from forge.resilience.nonfinite import NonFiniteError, NonFinitePolicy
from forge.resilience.preemption import EXIT_PREEMPTED, PreemptionHandler
from forge.resilience.watchdog import EXIT_HUNG, StepWatchdog

__all__ = [
    "EXIT_HUNG",
    "EXIT_PREEMPTED",
    "NonFiniteError",
    "NonFinitePolicy",
    "PreemptionHandler",
    "StepWatchdog",
]
