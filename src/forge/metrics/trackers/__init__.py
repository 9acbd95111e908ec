"""Optional experiment trackers behind MetricsLogger: TensorBoard, Weights & Biases, MLflow (rank 0 only)."""

from forge.metrics.trackers.base import Tracker, build_trackers

__all__ = ["Tracker", "build_trackers"]
