"""Optional experiment trackers behind MetricsLogger: TensorBoard, Weights & Biases, MLflow (rank 0 only)."""

from forge.metrics.trackers.base import TRACKER_NAMES, Tracker, build_trackers

__all__ = ["TRACKER_NAMES", "Tracker", "build_trackers"]
