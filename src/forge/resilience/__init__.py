"""Resilience: preemption signals, the non-finite loss policy, the step watchdog and lost-peer detection."""

from forge.resilience.liveness import EXIT_PEER_LOST, Liveness, PeerLostError
from forge.resilience.nonfinite import NonFiniteError, NonFinitePolicy
from forge.resilience.preemption import EXIT_PREEMPTED, PreemptionHandler
from forge.resilience.watchdog import EXIT_HUNG, StepWatchdog

__all__ = [
    "EXIT_HUNG",
    "EXIT_PEER_LOST",
    "EXIT_PREEMPTED",
    "Liveness",
    "NonFiniteError",
    "NonFinitePolicy",
    "PeerLostError",
    "PreemptionHandler",
    "StepWatchdog",
]
