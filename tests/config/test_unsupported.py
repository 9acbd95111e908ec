"""Each unsupported combination is refused by validation: exit 2, one line, before any process group or model.

They used to raise NotImplementedError after the process group and the model were built (a traceback, exit 1).
"""

import subprocess
import sys

import pytest

from forge.config import ConfigError, compose, validate
from forge.config.validate import UNSUPPORTED
from tests.conftest import ROOT, forge_cmd, one_line

CASES = {  # name -> (overrides, world size)
    "tp+moe+compile": (["parallel=tp2", "model=moe_tiny", "parallel.compile=true"], 2),
}


def test_every_table_entry_has_a_case_and_is_documented():
    status = (ROOT / "docs" / "status.md").read_text()
    for name, _, _ in UNSUPPORTED:
        assert name in CASES, name
        assert f"`{name}`" in status, f"docs/status.md does not list {name}"


@pytest.mark.parametrize("name", list(CASES))
def test_validation_refuses(name):
    overrides, world = CASES[name]
    with pytest.raises(ConfigError, match="is not supported"):
        validate(compose(overrides), world_size=world)


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_refuses(name):
    from forge.planning.report import plan_report

    overrides, world = CASES[name]
    with pytest.raises(ConfigError, match="is not supported"):
        plan_report(compose([*overrides, f"parallel.world_size={world}"]))


def test_plan_refuses_with_one_line(tmp_path):
    """The command line of one case (a process each; the plan's refusal of all is checked above, and torchrun's
    of tp+moe+compile below)."""
    overrides, world = CASES["tp+moe+compile"]
    cmd = forge_cmd("--plan", *overrides, f"parallel.world_size={world}", f"hydra.run.dir={tmp_path}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "is not supported" in one_line(proc)


@pytest.mark.dist
def test_torchrun_refuses_before_a_process_group(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "forge.train",
           *CASES["tp+moe+compile"][0], f"hydra.run.dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    refusals = [line for line in proc.stderr.splitlines() if "invalid config" in line]
    # the first rank to refuse ends the job; torchrun may stop the other before it prints its own refusal
    assert 1 <= len(refusals) <= 2 and "parallel.compile=true" in refusals[0], proc.stderr[-3000:]
    assert "forge/" not in proc.stderr.replace("-m forge.train", "")  # no frame of ours (torchrun reports its own)
