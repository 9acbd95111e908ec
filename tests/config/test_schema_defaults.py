"""The schema says what runs: every value of the default run (`forge-train` with no override, as `--cfg job` prints
it) is its schema's declared default, so `--help`, the docs and the code agree. The model group is the exception by
design: a model preset chooses a shape of its family, whose arguments class holds the family's own defaults (what
`TransformerArgs()` builds in code); `--help` prints the default run's model values."""

import dataclasses

from omegaconf import DictConfig, OmegaConf

from forge.config import compose


def differences(node: DictConfig, prefix: str) -> list[str]:
    """`key: schema X, runs Y` for each value of a typed node (and its typed children) that is not its default."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return [f for key in node if isinstance(child := node._get_node(key), DictConfig)
                for f in differences(child, f"{prefix}{key}.")]  # fmt: skip
    declared = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
    found = []
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            found += differences(child, f"{prefix}{key}.")
            continue
        runs = OmegaConf.to_container(node, resolve=False)[key]
        if declared.get(key, "<undeclared>") != runs:
            found.append(f"{prefix}{key}: schema {declared.get(key, '<undeclared>')!r}, runs {runs!r}")
    return found


def test_the_default_run_is_the_schemas_defaults():
    cfg = compose([])
    found = [f for group in cfg if group != "model" and cfg[group] is not None
             for f in differences(cfg[group], f"{group}.")]  # fmt: skip
    assert not found, "\n".join(found)


def test_a_preset_value_that_is_not_the_schemas_is_found():
    """The check above can fail: a group option that changes a value (the schedule's warmup) is reported."""
    cfg = compose(["scheduler.warmup_steps=7", "optimizer=lion"])
    found = differences(cfg.scheduler, "scheduler.") + differences(cfg.optimizer, "optimizer.")
    assert found == ["scheduler.warmup_steps: schema 20, runs 7"], found
