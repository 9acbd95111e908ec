"""Validation writes only what resolution fills (forge.config.resolve); its rules run on a read-only config, and
forge-train validates once per process."""

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from forge.config import compose, validate
from forge.config.resolve import read_only
from forge.config.validate import check_rules


def test_validation_writes_only_the_resolved_values():
    cfg = compose(["train.global_batch_size=8", "train.micro_batch_size=null", "train.max_micro_batch_size=2"])
    before = OmegaConf.to_container(cfg, resolve=False)
    validate(cfg, world_size=2)
    after = OmegaConf.to_container(cfg, resolve=False)
    changed = {f"{group}.{key}" for group in before if isinstance(before[group], dict)
               for key in before[group] if before[group][key] != after[group][key]}  # fmt: skip
    assert changed == {"train.micro_batch_size"}
    assert cfg.train.micro_batch_size == 2  # 8 over 2 ranks, at most 2 per micro-batch


def test_the_rules_run_read_only():
    cfg = compose([])
    degrees = validate(cfg, world_size=1)
    with read_only(cfg):
        check_rules(cfg, degrees)  # passes on a read-only config
        with pytest.raises(ReadonlyConfigError):
            cfg.train.steps = 3  # and a rule that wrote would fail
    cfg.train.steps = 3  # the flag is the config's own again


def test_a_trainer_given_the_degrees_does_not_validate_again(monkeypatch, tmp_path):
    """forge-train validates before the trainer's imports and hands the degrees on; a trainer built in-process
    without them validates itself (the control)."""
    import forge.train.trainer as trainer_module

    class Validated(Exception):
        pass

    class PastValidation(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Validated

    def stop(*args, **kwargs):
        raise PastValidation

    monkeypatch.setattr(trainer_module, "validate", refuse)
    monkeypatch.setattr(trainer_module, "PreemptionHandler", stop)  # the first thing after validation
    cfg = compose([])
    degrees = validate(cfg, world_size=1)
    with pytest.raises(PastValidation):
        trainer_module.Trainer(cfg, tmp_path, degrees)
    with pytest.raises(Validated):
        trainer_module.Trainer(cfg, tmp_path)
