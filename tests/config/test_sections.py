"""After validation the trainer's components get typed sections (forge.config.sections): each group as its schema's
instance, holding the values the run resolved."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from forge.config import compose, validate
from forge.config.schema import CheckpointConfig, MetricsConfig, ParallelConfig, ResilienceConfig, TrainConfig
from forge.config.sections import RunSections


def test_each_section_is_its_schemas_instance_with_the_resolved_values():
    interpolated = "metrics.run_name=${metrics.project}-${train.seed}"
    cfg = compose(
        ["train.global_batch_size=8", "train.micro_batch_size=null", "train.max_micro_batch_size=2", interpolated]
    )
    validate(cfg, world_size=2)
    sections = RunSections.of(cfg)
    expected = {
        "train": TrainConfig,
        "parallel": ParallelConfig,
        "checkpoint": CheckpointConfig,
        "resilience": ResilienceConfig,
        "metrics": MetricsConfig,
    }
    assert {f.name: type(getattr(sections, f.name)) for f in dataclasses.fields(sections)} == expected
    assert sections.train.micro_batch_size == 2  # what validation resolved (8 over 2 ranks, at most 2 each)
    assert sections.metrics.run_name == f"forge-{sections.train.seed}"
    for name in expected:  # every field as the config holds it, interpolations resolved
        assert dataclasses.asdict(getattr(sections, name)) == OmegaConf.to_container(cfg[name], resolve=True)


def test_a_section_composed_without_its_schema_is_refused():
    cfg = compose([])
    cfg.checkpoint = OmegaConf.create(OmegaConf.to_container(cfg.checkpoint))  # a plain mapping, no schema
    with pytest.raises(TypeError, match="checkpoint: expected the CheckpointConfig schema, got dict"):
        RunSections.of(cfg)


def test_the_trainers_components_hold_their_typed_sections(monkeypatch, tmp_path):
    import forge.train.trainer as trainer_module

    given = []

    def recording(model, mesh, degrees, parallel_cfg, *args):
        given.append(type(parallel_cfg))
        return parallelize(model, mesh, degrees, parallel_cfg, *args)

    parallelize = trainer_module.parallelize
    monkeypatch.setattr(trainer_module, "parallelize", recording)
    cfg = compose(["train.steps=1", "scheduler.warmup_steps=1", "train.eval_batches=1", "checkpoint.save_final=true"])
    trainer = trainer_module.Trainer(cfg, tmp_path)
    assert given == [ParallelConfig]
    assert type(trainer.checkpointer.cfg) is CheckpointConfig
    assert type(trainer.guard.cfg) is ResilienceConfig
    assert trainer.fit()["steps"] == 1
    assert (tmp_path / "checkpoints" / "step-00000001").is_dir()  # the typed checkpoint section saved it
