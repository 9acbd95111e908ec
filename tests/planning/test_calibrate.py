"""`forge-train --calibrate` under torchrun writes a device profile of measured rates; the search reads it in place
of the device table, and refuses a damaged one by name."""

import json
import subprocess
import sys

import pytest

from forge.config import ConfigError, compose
from forge.planning.search.calibrate import PROFILE, available_cores
from forge.planning.search.devices import device_from_profile
from forge.planning.search.report import search_report
from tests.conftest import ROOT

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("calibrate")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "forge.train",
           "--calibrate", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("device profile:") == 1  # rank 0 writes and prints
    return run_dir / PROFILE


def test_the_profile_holds_measured_rates(profile):
    data = json.loads(profile.read_text())
    assert data["world_size"] == 2 and not data["inter_node_measured"]
    assert set(data["collectives_bytes_per_s"]) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    assert all(rate > 0 for rate in data["collectives_bytes_per_s"].values())
    assert data["intra_node"] == data["inter_node"] == min(data["collectives_bytes_per_s"].values())
    assert data["peak_flops"]["fp32"] > 1e8 and data["memory_gib"] > 0
    assert 0 < data["collective_latency_s"] < 1
    assert device_from_profile(profile).latency_s == data["collective_latency_s"]  # the search's links use it
    assert device_from_profile(profile).latency_ranks == data["world_size"] == 2  # measured over the 2 ranks
    assert data["shares_cores"] == (2 * data["threads"] > available_cores())  # 2 ranks here: on 2 cores, true


def winner_step_seconds(report: str) -> float:
    """The step time of the table's first row."""
    row = next(line for line in report.splitlines() if line.lstrip().startswith("1 "))
    return float(row.split()[-4])


def test_the_search_predicts_with_the_profile(profile):
    overrides = ["search=default", "model=llama_tiny", "parallel.world_size=2", "train.dtype=fp32"]
    with_table = search_report(compose(overrides))
    with_profile = search_report(compose([*overrides, f"search.profile={profile}"]))
    assert f"(profile {profile})" in with_profile
    assert winner_step_seconds(with_profile) > 100 * winner_step_seconds(
        with_table
    )  # this CPU against an H100's table entry


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("not json", "not a readable JSON"),
        ('{"peak_flops": {"fp32": 1e9}, "inter_node": 0}', "inter_node is 0"),
        (
            '{"peak_flops": {"fp32": 1e9}, "inter_node": 1e9, "memory_gib": 8, "collective_latency_s": -1}',
            "collective_latency_s is -1",
        ),
        (
            '{"peak_flops": {"fp32": 1e9}, "inter_node": 1e9, "memory_gib": 8, "world_size": 2.5}',
            "world_size is 2.5, not a positive integer",
        ),
    ],
)
def test_a_damaged_profile_is_named(content, says, tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text(content)
    with pytest.raises(ConfigError, match=f"search.profile={bad}: .*{says}"):
        search_report(compose(["search=default", "parallel.world_size=2", f"search.profile={bad}"]))


def test_a_profile_without_a_latency_uses_the_tables(tmp_path):
    """Profiles written before the latency was measured (or by one process) still load: the cost model then charges
    forge.planning.search.cost.LATENCY_S."""
    old = tmp_path / "profile.json"
    old.write_text('{"peak_flops": {"fp32": 1e9}, "inter_node": 1e9, "memory_gib": 8}')
    assert device_from_profile(old).latency_s is None
    old.write_text('{"peak_flops": {"fp32": 1e9}, "inter_node": 1e9, "memory_gib": 8, "collective_latency_s": null}')
    assert device_from_profile(old).latency_s is None


def test_calibrate_and_plan_together_are_refused(tmp_path):
    cmd = [sys.executable, "-m", "forge.train", "--calibrate", "--plan", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--calibrate measures this machine" in proc.stderr
