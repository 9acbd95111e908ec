"""The signals a run can be asked to catch (resilience.preemption_signals), without torch: the config's
validation reads them before torch is imported."""

CATCHABLE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
"""The signals resilience.preemption_signals may name."""
