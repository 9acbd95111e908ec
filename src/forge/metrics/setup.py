"""What the trainer builds from the metrics section: the logger (rank 0), the step meter and the profiler."""

from pathlib import Path

import torch
import torch.distributed as torch_dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from forge.config.sections import RunSections
from forge.metrics.logger import MetricsLogger
from forge.metrics.meter import StepMeter, describe_peak
from forge.metrics.profiler import StepProfiler
from forge.planning.flops import training_flops_per_token
from forge.planning.peak import resolve_peak


def world_size() -> int:
    return torch_dist.get_world_size() if torch_dist.is_initialized() else 1


def rank() -> int:
    return torch_dist.get_rank() if torch_dist.is_initialized() else 0


def config_dict(cfg: DictConfig) -> dict:
    """The composed config as plain containers, for trackers' run configs."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception:  # an interpolation only Hydra's runtime resolves
        return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def build_metrics_logger(
    settings: RunSections, config: dict, run_dir: Path, tracker_ids: dict[str, str]
) -> MetricsLogger:
    """metrics.jsonl, console and the configured trackers (continuing the runs in tracker_ids); `config`, the whole
    run's config (config_dict), is what the trackers record."""
    return MetricsLogger.from_config(settings.metrics, run_dir, settings.train.steps, tracker_ids, config)


def build_step_meter(settings: RunSections, model: nn.Module, device: torch.device, dtype: str) -> StepMeter:
    """Step timing and MFU; only rank 0 resolves (and possibly measures) the peak, since only it logs."""
    flops = training_flops_per_token(model, settings.train.seq_len)
    peak = None
    if rank() == 0:
        peak = resolve_peak(device, dtype, settings.metrics.peak_tflops, settings.metrics.measure_peak)
        describe_peak(flops, peak)
    return StepMeter(device, flops, peak, world_size())


def build_profiler(settings: RunSections, run_dir: Path, device: torch.device) -> StepProfiler:
    m = settings.metrics
    return StepProfiler(
        run_dir, m.profile_start_step, m.profile_end_step, settings.train.steps, device, m.memory_snapshot, rank()
    )
