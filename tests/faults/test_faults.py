"""Kill, preempt, poison, stall and starve real training processes; resumed curves match uninterrupted ones."""

import os
import random
import signal
import subprocess
import time

import pytest

from forge.checkpoint.layout import complete_checkpoints, latest_checkpoint
from forge.resilience import EXIT_HUNG, EXIT_PREEMPTED
from tests.faults.conftest import finish, kill, losses, start, train, wait_for_step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's loss curve."""
    run_dir = tmp_path_factory.mktemp("reference")
    code, out = train(run_dir)
    assert code == 0, out
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 17))
    return curve


def test_sigterm_checkpoints_exits_75_and_resumes_bitwise(tmp_path, reference):
    proc = start(tmp_path)
    wait_for_step(proc, tmp_path, 5)
    kill(proc, signal.SIGTERM)
    code, out = finish(proc)
    assert code == EXIT_PREEMPTED, out
    assert "preempted (SIGTERM)" in out
    stopped_at = max(losses(tmp_path))
    assert latest_checkpoint(tmp_path / "checkpoints").name == f"step-{stopped_at:08d}"
    code, out = train(tmp_path)
    assert code == 0, out
    assert losses(tmp_path) == reference


def test_ctrl_c_checkpoints_exits_130_in_one_line_and_resumes_bitwise(tmp_path, reference):
    proc = start(tmp_path)
    wait_for_step(proc, tmp_path, 5)
    kill(proc, signal.SIGINT)
    code, out = finish(proc)
    assert code == 130, out
    assert "interrupted (SIGINT)" in out and "Traceback" not in out and "KeyboardInterrupt" not in out
    stopped_at = max(losses(tmp_path))
    assert latest_checkpoint(tmp_path / "checkpoints").name == f"step-{stopped_at:08d}"
    code, out = train(tmp_path)
    assert code == 0, out
    assert losses(tmp_path) == reference


def test_random_sigkills_never_load_a_partial_checkpoint(tmp_path, reference):
    """SIGKILL at random moments (inside steps and inside checkpoint writes), resume, repeat; same curve.

    FORGE_FAULT_KILLS=N asks for N kills; each aims one or two steps past the last progress and the run grows to
    2N + 2 steps, so nearly all N happen (12 asked gave 11; e.g. FORGE_FAULT_KILLS=300 for a soak)."""
    kills = int(os.environ.get("FORGE_FAULT_KILLS", "3"))
    steps = max(16, 2 * kills + 2)
    longer = [f"train.steps={steps}"]
    expected = reference
    if steps != 16:
        code, out = train(tmp_path / "reference", *longer)
        assert code == 0, out
        expected = losses(tmp_path / "reference")
    run = tmp_path / "run"
    rng = random.Random(1234)
    survived = 0
    for _ in range(kills):
        done = max(losses(run), default=0)
        if done >= steps - 1:
            break
        proc = start(run, *longer)  # after the check: a run left going would race the final one for the last save
        wait_for_step(proc, run, rng.randint(done + 1, min(done + 2, steps - 1)))
        time.sleep(rng.uniform(0.0, 0.3))  # lands inside a step or inside a checkpoint write
        kill(proc)
        proc.wait()
        survived += 1
        for ckpt in complete_checkpoints(run / "checkpoints"):
            assert (ckpt / ".metadata").is_file() and (ckpt / "extra-rank0.pt").is_file()
    code, out = train(run, *longer)
    assert code == 0, out
    assert "resumed from" in out
    print(f"survived {survived} random SIGKILLs with an identical loss curve")
    assert losses(run) == expected


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> dict[str, tuple[int, str, dict]]:
    """The run with a NaN loss at step 7 under the skip and the rollback policy: (exit code, output, losses)."""
    runs = {}
    for policy in ("skip", "rollback"):
        run = tmp_path_factory.mktemp(policy)
        code, out = train(run, "resilience.inject_nan_at_step=7", f"resilience.nonfinite_policy={policy}")
        runs[policy] = (code, out, losses(run))
    return runs


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_nan_policies_skip_the_poisoned_step(poisoned, reference, policy):
    code, out, curve = poisoned[policy]
    assert code == 0, out
    assert "non-finite loss or gradient norm at step 7" in out
    assert [curve[s] for s in range(1, 7)] == [reference[s] for s in range(1, 7)]
    assert all(curve[s] != reference[s] for s in range(8, 17))


def test_rollback_curve_equals_skip_curve(poisoned):
    """Rolling back and skipping the poisoned batches leaves the same model as not stepping on them."""
    out = poisoned["rollback"][1]
    assert "rolling back" in out and "resumed from" in out
    skip, rollback = poisoned["skip"][2], poisoned["rollback"][2]
    assert [skip[s] for s in range(8, 17)] == [rollback[s] for s in range(8, 17)]


def mlflow_status(run_dir, monkeypatch) -> str:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as forge's tracker sets for file stores

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    (run,) = client.search_runs([experiment.experiment_id])
    return run.info.status


def wandb_exit_code(run_dir) -> int | None:
    """The exit code in the offline run file's exit record, or None when the run was never finished."""
    from tests.metrics.wandb_records import read_records

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in read_records(path) if r.WhichOneof("record_type") == "exit"]
    return exits[-1] if exits else None


def test_nan_raise_policy_fails_loudly(tmp_path, monkeypatch):
    code, out = train(
        tmp_path, "resilience.inject_nan_at_step=3", "resilience.nonfinite_policy=raise", "metrics.trackers=[mlflow]"
    )
    assert code != 0
    assert "NonFiniteError" in out and "step 3" in out
    assert mlflow_status(tmp_path, monkeypatch) == "FAILED"  # not left RUNNING by the crash


def test_stalled_step_is_ended_by_the_watchdog(tmp_path, monkeypatch):
    code, out = train(
        tmp_path,
        "resilience.inject_stall_at_step=6",
        "resilience.watchdog_factor=10",
        "resilience.watchdog_min_s=3",
        "metrics.trackers=[mlflow,wandb]",
    )
    assert code == EXIT_HUNG, out
    assert "watchdog: step 6 has run" in out and "in _inject_stall" in out  # where the main thread hangs
    # The hard exit still ends the tracker runs, as failed with the watchdog's code.
    assert mlflow_status(tmp_path, monkeypatch) == "FAILED"
    assert wandb_exit_code(tmp_path) == EXIT_HUNG
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 5]


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, reference):
    """A tmpfs too small for a second checkpoint: a clear error, and the first checkpoint stays loadable."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        pytest.skip(f"cannot mount a tmpfs here ({err}); the full-disk scenario needs root")
    try:
        code, out = train(tmp_path / "run", f"checkpoint.dir={mount}")
        assert code != 0
        assert "MB free on that disk" in out
        first = latest_checkpoint(mount)
        assert first is not None and first.name == "step-00000002"
        assert "forge-train: cannot write checkpoint" in out and "Traceback" not in out
        code, out = train(
            tmp_path / "going",
            f"checkpoint.dir={mount}",
            "checkpoint.on_save_error=continue",
            "checkpoint.resume=none",
            "checkpoint.overwrite=true",  # the first run's checkpoints share this folder
            "train.steps=6",
        )
        assert "training continues" in out, out
        assert code == 1 and "the run ended without its last checkpoint" in out, out  # not a silent success
        assert latest_checkpoint(mount).name == "step-00000002"
        assert sorted(p.name for p in mount.glob("step-*")) == ["step-00000002"]  # failed saves left no folder
        code, out = train(tmp_path / "resumed", f"checkpoint.dir={mount}", "checkpoint.interval=0")
        assert code == 0, out
        assert "resumed from" in out
    finally:
        subprocess.run(["umount", str(mount)], check=False)
