"""Resilience: preemption signals, the non-finite loss policy, the step watchdog and lost-peer detection.

The names below are imported on first use: the config's validation reads forge.resilience.signals before torch."""

from forge.lazy import lazy_exports

_EXPORTS = {
    "EXIT_HUNG": "forge.resilience.watchdog",
    "EXIT_PEER_LOST": "forge.resilience.liveness",
    "EXIT_PREEMPTED": "forge.resilience.preemption",
    "Liveness": "forge.resilience.liveness",
    "NonFiniteError": "forge.resilience.nonfinite",
    "NonFinitePolicy": "forge.resilience.nonfinite",
    "PeerLostError": "forge.resilience.liveness",
    "PreemptionHandler": "forge.resilience.preemption",
    "StepWatchdog": "forge.resilience.watchdog",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
