"""A model family is one folder: the generic machinery finds it through its spec (forge.models.spec), and nothing
outside the folder names it."""

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from forge.config import compose, validate
from forge.config.errors import ConfigError
from forge.models.spec import PARALLEL_DIMS, families, known_spec, spec_of
from forge.train.build import build_meta_model, model_args
from tests.conftest import ROOT, forge_cmd

SRC = Path(__file__).resolve().parents[2] / "src" / "forge"
CONF = SRC.parents[1] / "conf"


def family_folders() -> list[Path]:
    return sorted(p.parent for p in (SRC / "models").glob("*/spec.py"))


def top_level_names(files) -> set[str]:
    names = set()
    for file in files:
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and not node.name.startswith("_"):
                names.add(node.name)
    return names


def defined_names(folder: Path) -> set[str]:
    """The classes and top-level functions only this family's folder defines (what another module would import)."""
    elsewhere = top_level_names(f for f in SRC.rglob("*.py") if folder not in f.parents)
    return top_level_names(folder.rglob("*.py")) - elsewhere


def test_every_family_folder_is_discovered_and_builds_from_its_presets():
    """families() finds each folder with a spec module; every conf/model preset resolves to one of them, and its
    model, built on the meta device, is found again from the model, its args and the config node."""
    specs = {spec.name: spec for spec in families()}
    assert {folder.name for folder in family_folders()} == set(specs)
    assert {"llama", "gpt2"} <= set(specs)
    for preset in sorted(CONF.glob("model/*.yaml")):
        cfg = compose([f"model={preset.stem}"])
        spec = spec_of(cfg.model)
        assert spec.name in specs, preset
        args = model_args(cfg)
        assert isinstance(args, spec.args) and spec_of(args) is spec
        assert known_spec(spec.target) is spec
        assert set(spec.parallel) <= set(PARALLEL_DIMS)


@pytest.mark.parametrize("folder", family_folders(), ids=lambda p: p.name)
def test_a_family_is_named_nowhere_else_in_the_source(folder):
    """No file of src/forge outside the family's folder imports it or names what it defines (the generic code
    reaches it through its spec alone); llama is named by the defaults that predate the families (the model
    schema's target, forge-convert's default for configs saved without one) and is exempt from this rule."""
    if folder.name == "llama":
        pytest.skip("the default family: the model schema (config/schema.py) extends its arguments")
    package = f"forge.models.{folder.name}"
    names = defined_names(folder)
    assert names, folder
    found = []
    for file in SRC.rglob("*.py"):
        if folder in file.parents:
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            used = {
                ast.Name: lambda n: n.id,
                ast.Attribute: lambda n: n.attr,
                ast.alias: lambda n: n.name,
                ast.ImportFrom: lambda n: n.module or "",
                ast.Constant: lambda n: n.value if isinstance(n.value, str) else "",
            }.get(type(node), lambda n: "")(node)
            if used in names or package in used or f"models/{folder.name}" in used:
                found.append(f"{file.relative_to(SRC)}:{node.lineno}: {used[:80]}")
    assert not found, found
    presets = [p.name for p in CONF.rglob("*.yaml") if package in p.read_text()]
    assert presets and all(name.startswith(f"{folder.name}_") for name in presets), presets


def test_a_parallel_dimension_the_family_lacks_is_refused_in_one_line():
    """The spec's `parallel` says which dimensions a family runs; another is refused before its own rules."""
    for dim in ("pp", "ep"):
        cfg = compose(["model=gpt2_tiny", f"parallel.{dim}=2", "parallel.world_size=2"])
        with pytest.raises(ConfigError, match=rf"parallel.{dim}=2 is not supported by the gpt2 model family"):
            validate(cfg)


def test_a_preset_without_a_schema_is_typed_by_its_arguments_class():
    """A family's preset extends no schema: its node is typed by the `_target_` class, so an unknown key or a
    value outside a field's domain is one line naming it, and the run's node is plain again afterwards."""
    with pytest.raises(ConfigError, match=r"model.n_layrs"):
        validate(compose(["model=gpt2_tiny", "+model.n_layrs=3"]))
    with pytest.raises(ConfigError, match=r"model.n_layers=0"):
        validate(compose(["model=gpt2_tiny", "model.n_layers=0"]))
    cfg = compose(["model=gpt2_tiny"])
    validate(cfg)
    assert OmegaConf.get_type(cfg.model) is dict
    assert type(build_meta_model(cfg)).__name__ == spec_of(cfg.model).build.__name__


def test_a_family_outside_forge_trains_without_touching_it(tmp_path):
    """A copy of the GPT-2 folder as a package of the user's own (`toyfam`, on PYTHONPATH), named by the preset's
    `_target_` only: forge-train validates, trains and checkpoints it with no file of forge changed."""
    package = tmp_path / "toyfam"
    shutil.copytree(SRC / "models" / "gpt2", package, ignore=shutil.ignore_patterns("__pycache__"))
    for file in package.glob("*.py"):
        file.write_text(file.read_text().replace("forge.models.gpt2", "toyfam"))
    run_dir = tmp_path / "run"
    cmd = forge_cmd("model=gpt2_tiny", "model._target_=toyfam.args.GPT2Args", "train.steps=2", "train.eval_batches=1",
                    "checkpoint.save_final=true", f"hydra.run.dir={run_dir}")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (run_dir / "forge.log").read_text()
    assert "done: 2 steps" in log
    saved = yaml.safe_load(next(run_dir.glob("checkpoints/step-*/config.yaml")).read_text())
    assert saved["model"]["_target_"] == "toyfam.args.GPT2Args"
