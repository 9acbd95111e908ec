"""A checkpoint folder from someone else runs no code: a planted `.metadata` pickle, a planted non-tensor value in
the DCP data, or a planted `_target_` in config.yaml is refused by every tool that reads it, with one line naming
the file, a non-zero exit and no traceback, and the payload (touching a marker file) never runs. forge-train runs
as a process; the other tools' main(argv) run in this one (an escaped exception fails the test)."""

import contextlib
import importlib
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import forge
from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.run_config import load_run_config
from forge.checkpoint.untrusted import load_dcp, read_metadata
from forge.config import compose
from forge.train.trainer import Trainer
from tests.checkpoint.test_convert import TINY as CONVERT_TINY

TINY = [*CONVERT_TINY, "train.steps=2", "checkpoint.interval=2"]
STEP = "step-00000002"


class Call:
    """Pickles as `fn(arg)`: what a crafted pickle runs when it is loaded."""

    def __init__(self, fn, arg: str):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def touch_with(kind: str, marker: Path) -> Call:
    if kind == "os.system":
        return Call(os.system, f"touch {marker}")
    return Call(exec, f"open({str(marker)!r}, 'w').close()")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The one tiny trained run of this module; tests plant payloads in copies of it."""
    folder = tmp_path_factory.mktemp("trusted")
    Trainer(compose(TINY), folder).fit()
    return folder


@pytest.fixture
def planted(trained, tmp_path) -> Path:
    """A copy of the trained run's checkpoint folder (tmp_path/run/checkpoints/STEP), to plant a payload in."""
    shutil.copytree(trained / "checkpoints", tmp_path / "run" / "checkpoints")
    return tmp_path / "run" / "checkpoints" / STEP


def run(tmp_path: Path, module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def run_in_process(module: str, args: list[str], capsys, monkeypatch, cwd: Path) -> subprocess.CompletedProcess:
    """The tool's main(args) in this process, as the command line would end: its exit code and what it printed.
    forge-train runs as a process (run); the other tools are plain functions of their arguments."""
    main = importlib.import_module(module).main
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
        if not isinstance(exit_.code, int) and exit_.code is not None:
            print(exit_.code, file=sys.stderr)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_refused(result: subprocess.CompletedProcess, marker: Path, *named: str) -> None:
    """Non-zero exit, the payload never ran, stderr is one line naming `named`, no traceback."""
    assert not marker.exists(), "the payload ran"
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for text in named:
        assert text in lines[0], result.stderr


def tool_args(tool: str, step: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """(module, arguments) running `tool` on the checkpoint folder `step`."""
    train = [*TINY, "train.steps=4", f"hydra.run.dir={tmp_path / 'new'}"]
    return {
        "resume": ("forge.train", [*train, f"checkpoint.resume={step}"]),
        "warm-start": ("forge.train", [*train, "checkpoint.resume=none", f"checkpoint.load_weights={step}"]),
        "generate": ("forge.generate.cli", [f"checkpoint={step}", "prompt=KING.", "max_new_tokens=2"]),
        "generate-vlm": ("forge.generate.cli", [f"checkpoint={step}", "image=x.png", "prompt=what?"]),
        "eval": ("forge.generate.evaluate", [f"checkpoint={step}", "batches=1"]),
        "convert": ("forge.checkpoint.cli", ["--to", "hf", str(step), str(tmp_path / "hf")]),
        "lm-eval": ("forge.generate.lm_eval_adapter", [f"checkpoint={step}", "task_docs=4", "limit=2"]),
    }[tool]


# ---- .metadata -----------------------------------------------------------------------------------------------


def plant_metadata(step: Path, call: Call) -> None:
    """The real metadata with `call` hidden in one of its fields."""
    with open(step / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own trusted file
    metadata.planner_data = {"x": call}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec"])
def test_a_planted_metadata_pickle_would_run_and_read_metadata_refuses_it(planted, tmp_path, kind):
    marker = tmp_path / "MARKER"
    plant_metadata(planted, touch_with(kind, marker))
    pickle.loads((planted / ".metadata").read_bytes())  # what torch's FileSystemReader does
    assert marker.exists(), "the payload is not live"
    marker.unlink()
    name = "posix.system" if kind == "os.system" else "builtins.exec"
    with pytest.raises(CheckpointError, match=f"refusing to load {planted / '.metadata'}: it references {name},"):
        read_metadata(planted)
    with pytest.raises(CheckpointError, match="refusing to load"):
        forge.load_pretrained(planted)
    assert not marker.exists()


@pytest.mark.parametrize("tool", ["resume", "warm-start", "generate", "eval", "convert", "lm-eval"])
def test_every_tool_refuses_a_planted_metadata_pickle(planted, tmp_path, tool, capsys, monkeypatch):
    marker = tmp_path / "MARKER"
    plant_metadata(planted, touch_with("os.system", marker))
    module, args = tool_args(tool, planted, tmp_path)
    if module == "forge.train":
        result = run(tmp_path, module, *args)
    else:
        result = run_in_process(module, args, capsys, monkeypatch, tmp_path)
    assert_refused(result, marker, f"{planted / '.metadata'}: it references posix.system")
    assert not (tmp_path / "hf").exists()


# ---- non-tensor values in the DCP data -------------------------------------------------------------------------


def test_a_planted_optimizer_value_would_run_under_stock_dcp_and_resume_refuses_it(planted, tmp_path):
    """DCP reads non-tensor values (here the learning rate in the optimizer's param_groups) with
    torch.load(weights_only=False); forge's planner reads them with weights_only=True."""
    marker = tmp_path / "MARKER"
    dcp_to_torch_save(planted, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)  # our own trusted file
    state["optim"]["param_groups"][0]["lr"] = touch_with("os.system", marker)
    dcp.save(state, checkpoint_id=str(planted), no_dist=True)
    dcp.load({"optim": {"param_groups": state["optim"]["param_groups"]}}, checkpoint_id=str(planted), no_dist=True)
    assert marker.exists(), "the payload is not live"
    marker.unlink()
    module, args = tool_args("resume", planted, tmp_path)
    result = run(tmp_path, module, *args)
    assert_refused(result, marker, f"cannot load checkpoint {planted}", "Weights only load failed")


# ---- config.yaml ---------------------------------------------------------------------------------------------


def payload(kind: str, marker: Path, tmp_path: Path) -> dict:
    """A `data` (or `vlm`) node whose instantiation touches `marker`."""
    if kind == "torch.load":
        torch.save(touch_with("os.system", marker), tmp_path / "evil.pt")
        return {"_target_": "torch.load", "f": str(tmp_path / "evil.pt"), "weights_only": False}
    if kind == "pathlib.Path.touch":
        return {"_target_": "pathlib.Path.touch", "_args_": [str(marker)]}
    if kind == "os.system":
        return {"_target_": "os.system", "_args_": [f"touch {marker}"]}
    if kind == "builtins.exec":
        return {"_target_": "builtins.exec", "_args_": [f"open({str(marker)!r}, 'w').close()"]}
    if kind == "nested":
        inner = payload("torch.load", marker, tmp_path)
        return {"_target_": "forge.data.embedded.EmbeddedCorpus", "tokenizer": inner, "vocab_size": 8192}
    assert kind == "interpolated"
    return {**payload("torch.load", marker, tmp_path), "_target_": "${oc.decode:'torch.load'}"}


TARGET_OF = {
    "torch.load": "data._target_ is 'torch.load'",
    "pathlib.Path.touch": "data._target_ is 'pathlib.Path.touch'",
    "os.system": "data._target_ is 'os.system'",
    "builtins.exec": "data._target_ is 'builtins.exec'",
    "nested": "data.tokenizer._target_ is 'torch.load'",
    "interpolated": "data._target_ is 'torch.load'",
}
HYDRA_BLOCKS = {"os.system", "builtins.exec"}
"""Payloads Hydra 1.3.8's own blocklist already refuses; the others it instantiates."""


def plant_config(step: Path, group: str, node: dict) -> None:
    config = yaml.safe_load((step / "config.yaml").read_text())
    config[group] = node
    (step / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.parametrize("kind", list(TARGET_OF))
def test_a_planted_target_would_run_and_load_run_config_refuses_it(planted, tmp_path, kind):
    marker = tmp_path / "MARKER"
    node = payload(kind, marker, tmp_path)
    if kind in HYDRA_BLOCKS:
        with pytest.raises(InstantiationException, match="blocklisted"):
            instantiate(OmegaConf.create(node))
    else:
        with contextlib.suppress(Exception):  # the nested payload runs, then its outer target fails
            instantiate(OmegaConf.create(node))  # what forge-generate & co did with a checkpoint's data config
        assert marker.exists(), "the payload is not live"
        marker.unlink()
    plant_config(planted, "data", node)
    with pytest.raises(CheckpointError, match=f"refusing to load {planted / 'config.yaml'}: {TARGET_OF[kind]},"):
        load_run_config(planted / "config.yaml")
    assert not marker.exists()


def test_forge_s_own_targets_pass(trained):
    config = load_run_config(trained / "checkpoints" / STEP / "config.yaml")
    assert config.data._target_ == "forge.data.embedded.EmbeddedCorpus"


@pytest.mark.parametrize(
    ("tool", "kind"),
    [("generate", "torch.load"), ("eval", "pathlib.Path.touch"), ("lm-eval", "os.system"), ("convert", "nested")],
)
def test_every_tool_refuses_a_planted_data_target(planted, tmp_path, tool, kind, capsys, monkeypatch):
    marker = tmp_path / "MARKER"
    plant_config(planted, "data", payload(kind, marker, tmp_path))
    module, args = tool_args(tool, planted, tmp_path)
    result = run_in_process(module, args, capsys, monkeypatch, tmp_path)
    assert_refused(result, marker, f"{planted / 'config.yaml'}: {TARGET_OF[kind]}")
    assert not (tmp_path / "hf").exists()


def test_generate_about_an_image_refuses_a_planted_vlm_target(planted, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "MARKER"
    plant_config(planted, "vlm", payload("torch.load", marker, tmp_path))
    module, args = tool_args("generate-vlm", planted, tmp_path)
    result = run_in_process(module, args, capsys, monkeypatch, tmp_path)
    assert_refused(result, marker, f"{planted / 'config.yaml'}: vlm._target_ is 'torch.load'")


def test_a_checkpoint_of_every_value_kind_round_trips(tmp_path):
    """The allowlists admit what DCP writes for tensors of other dtypes and for non-tensor values."""
    state = {"a": torch.arange(4, dtype=torch.bfloat16), "b": torch.arange(3), "c": 1.5, "d": {"e": [1, "x", None]}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    loaded = {
        "a": torch.zeros(4, dtype=torch.bfloat16),
        "b": torch.zeros(3, dtype=torch.int64),
        "c": 0.0,
        "d": {"e": None},
    }
    load_dcp(loaded, tmp_path)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    assert loaded["c"] == 1.5 and loaded["d"] == state["d"]
    assert "a" in read_metadata(tmp_path).state_dict_metadata
