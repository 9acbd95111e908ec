"""Metrics: metrics.jsonl, the console line, trackers, FLOPs/MFU, memory and the profiler."""

from forge.metrics.logger import MetricsLogger
from forge.metrics.meter import StepMeter
from forge.metrics.profiler import StepProfiler
from forge.planning.flops import count_flops_per_token, training_flops_per_token
from forge.planning.peak import resolve_peak

__all__ = [
    "MetricsLogger",
    "StepMeter",
    "StepProfiler",
    "count_flops_per_token",
    "resolve_peak",
    "training_flops_per_token",
]
