"""A checkpoint's config.yaml read as untrusted input: only forge's own data, model and vlm targets are admitted.

forge-generate, forge-eval, forge-lm-eval and `forge-convert --to hf` instantiate the `data` (and for a VLM the
`model` and `vlm`) nodes of the run config saved in a checkpoint. A `_target_` there is a callable Hydra imports
and calls: `os.system`, `builtins.exec` or `torch.load` from a folder someone else wrote would run their code, and
Hydra's own blocklist does not stop them. So every `_target_` under those nodes, at any depth and after resolving
interpolations, must be one that an option of conf/<group> (or the schema it extends) uses.
"""

import functools
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf

from forge.checkpoint.errors import CheckpointError
from forge.models.spec import known_spec

INSTANTIATED_GROUPS = ("data", "model", "vlm")


@functools.cache
def forge_targets() -> dict[str, frozenset[str]]:
    """group -> the `_target_` of every option in conf/<group>: its own, or the default of a schema it extends."""
    from forge.config.paths import conf_dir
    from forge.config.schema import SCHEMAS

    table = {}
    for group in INSTANTIATED_GROUPS:
        targets = set()
        for option in (conf_dir() / group).glob("*.yaml"):
            node = yaml.safe_load(option.read_text()) or {}
            extends = [e[1:].split("@")[0] for e in node.get("defaults", []) if isinstance(e, str) and e[:1] == "/"]
            targets.add(node.get("_target_"))
            targets.update(getattr(SCHEMAS.get(name), "_target_", None) for name in extends)
        table[group] = frozenset(t for t in targets if isinstance(t, str) and t != MISSING)
    return table


def load_run_config(file: Path) -> DictConfig:
    """The config in `file`, resolved, or a CheckpointError naming the file and the first target it refuses."""
    try:
        plain = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except Exception as err:  # noqa: BLE001 - any failure to parse or resolve is a corrupt checkpoint
        raise CheckpointError(f"cannot read {file}: {str(err).strip().splitlines()[0]}") from err
    if not isinstance(plain, dict):
        raise CheckpointError(f"cannot read {file}: it is not a mapping")
    table = forge_targets()
    _rename_model_target(plain.get("model"))
    for group in INSTANTIATED_GROUPS:
        _check(plain.get(group), group, group, table[group], file)
    return OmegaConf.create(plain)


def _rename_model_target(model: Any) -> None:
    """A model `_target_` that a family's arguments class had before it moved (a config saved by an older forge)
    becomes the class's current path."""
    if isinstance(model, dict) and isinstance(model.get("_target_"), str):
        spec = known_spec(model["_target_"])
        if spec is not None:
            model["_target_"] = spec.target


def _check(node: Any, where: str, group: str, allowed: frozenset[str], file: Path) -> None:
    """Raise CheckpointError at the first `_target_` under `node` outside `allowed`, or a string that would
    interpolate again (OmegaConf.create re-reads `${...}` in the resolved values)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_" and not (isinstance(value, str) and value in allowed):
                raise CheckpointError(
                    f"refusing to load {file}: {where}._target_ is {value!r}, not one of forge's own {group} targets"
                )
            _check(value, f"{where}.{key}", group, allowed, file)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check(value, f"{where}[{i}]", group, allowed, file)
    elif isinstance(node, str) and "${" in node:
        raise CheckpointError(f"refusing to load {file}: {where} is {node!r}, an interpolation after resolving")
