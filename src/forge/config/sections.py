"""The run's typed sections: after validation, each component of the trainer gets its group as an instance of
the group's schema (forge.config.schema), not the composed DictConfig.

The groups that `_target_` builds (model, data, optimizer, scheduler, loss, vlm) stay config nodes: Hydra
instantiates them, and the whole config is still what a checkpoint, the trackers and the run folder record.
"""

from dataclasses import dataclass, fields

from omegaconf import DictConfig, OmegaConf

from forge.config.schema import CheckpointConfig, MetricsConfig, ParallelConfig, ResilienceConfig, TrainConfig


@dataclass(frozen=True)
class RunSections:
    """The sections the trainer's components read, resolved and typed: a snapshot of the validated config (the
    run changes nothing in it after validation)."""

    train: TrainConfig
    """Steps, batch, dtype, device and the loop's cadence."""
    parallel: ParallelConfig
    """The layout and its transforms (the degrees themselves: forge.config.degrees)."""
    checkpoint: CheckpointConfig
    """Saving, resuming and exporting."""
    resilience: ResilienceConfig
    """Signals, watchdogs, non-finite steps and replica groups."""
    metrics: MetricsConfig
    """Logging, trackers and profiling."""

    @classmethod
    def of(cls, cfg: DictConfig) -> "RunSections":
        """The sections of a validated config (validation fills and checks them; this only reads)."""
        return cls(**{f.name: typed_section(cfg, f.name, f.type) for f in fields(cls)})  # type: ignore[arg-type]


def typed_section(cfg: DictConfig, name: str, schema: type) -> object:
    """Section `name` of `cfg` as an instance of `schema`, interpolations resolved."""
    section = OmegaConf.to_object(cfg[name])
    if not isinstance(section, schema):  # a config composed without the schemas registered
        raise TypeError(f"{name}: expected the {schema.__name__} schema, got {type(section).__name__}")
    return section
