"""Metrics: metrics.jsonl, the console line and trackers."""

from forge.metrics.logger import MetricsLogger

__all__ = ["MetricsLogger"]
