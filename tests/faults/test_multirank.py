"""Faults in one rank of a two-rank torchrun job: the job ends with an error naming the rank, then resumes bitwise.

FORGE_FAULT_RANK_KILLS sets how many random SIGKILLs of one rank the kill test injects (default 1; the runs grow
two steps per kill, e.g. 100 kills train 204 steps).
"""

import json
import os
import pickle
import random
import signal
import time

import pytest

from forge.checkpoint.layout import complete_checkpoints, latest_checkpoint, step_of
from forge.resilience import EXIT_HUNG, EXIT_PEER_LOST
from tests.faults.conftest import finish, losses, wait_for_step
from tests.faults.ranks import start_torchrun, worker_pid

pytestmark = [pytest.mark.slow, pytest.mark.dist]

KILLS = int(os.environ.get("FORGE_FAULT_RANK_KILLS", "1"))
STEPS = max(10, 2 * KILLS + 4)


def start(run_dir, *overrides: str):
    return start_torchrun(run_dir, f"train.steps={STEPS}", *overrides)


def run_torchrun(run_dir, *overrides: str) -> tuple[int, str]:
    return finish(start(run_dir, *overrides))


def assert_sealed_checkpoints_are_whole(root) -> None:
    for ckpt in complete_checkpoints(root):
        assert (ckpt / ".metadata").is_file(), ckpt
        assert (ckpt / "extra-rank0.pt").is_file() and (ckpt / "extra-rank1.pt").is_file(), ckpt


def resumed_from(out: str) -> int:
    """The step of the checkpoint a run says it resumed from."""
    line = next(line for line in out.splitlines() if "resumed from" in line)
    return int(line.split("step-")[1][:8])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted two-rank run (its folder and output). Rank 1 works 0.4 s longer each step (a spin, no
    change to any number): the straggler report must name it, also on a loaded machine, where both ranks' time
    waiting for a CPU counts as busy too."""
    run_dir = tmp_path_factory.mktemp("reference2")
    code, out = run_torchrun(run_dir, "resilience.inject_slow_rank=1", "resilience.inject_slow_s=0.4")
    assert code == 0, out[-3000:]
    return run_dir, out


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted two-rank run's loss curve."""
    curve = losses(reference_run[0])
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve


def test_a_slow_rank_is_named_on_every_log_step(reference_run):
    run_dir, out = reference_run
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(records) == STEPS
    for record in records:  # its busy time is ~0.4 s, rank 0's some 20 ms (idle machine) to 100 ms (loaded)
        assert record["straggler_ranks"] == [1], record
        assert record["busy_time_max_over_median"] > 1.5, record  # the default straggler_factor
    lines = [line for line in out.splitlines() if "| loss " in line]
    assert len(lines) == STEPS and all("| slow ranks 1 (busy " in line for line in lines), lines


def test_a_stalled_rank_is_named_and_the_job_resumes_bitwise(tmp_path, reference):
    """Rank 1 hangs before step 6: rank 0's liveness check names it (exit 77), rank 1's watchdog ends it (76)
    and says, from the ranks' progress in the store, that rank 1 is the one behind.

    The collective timeout stays at its long default: the liveness check exists so that it can.
    """
    code, out = run_torchrun(
        tmp_path,
        "resilience.inject_stall_at_step=6",
        "resilience.inject_stall_rank=1",
        "resilience.liveness_every_steps=1",
        "resilience.liveness_timeout_s=2",
        "resilience.watchdog_factor=10",
        "resilience.watchdog_min_s=6",
    )
    assert code != 0, out[-3000:]
    assert "rank 0: liveness check at step 6: rank 1 did not reach it within 2 s (stalled or dead)" in out, out[-3000:]
    assert f"exitcode  : {EXIT_PEER_LOST}" in out and f"exitcode  : {EXIT_HUNG}" in out
    assert "watchdog: rank 1, step 6 has run" in out and "_inject_stall" in out
    # The watchdog also reads the ranks' progress from the job's store: rank 0 started step 6, rank 1 did not.
    assert "last started step per rank: 0: 6, 1: 5; rank 1 did not start step 6 (stalled or dead before it)" in out
    assert max(losses(tmp_path)) == 5
    assert_sealed_checkpoints_are_whole(tmp_path / "checkpoints")
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-00000004"
    # each rank that ended the job wrote its flight recorder: the training group's collectives of both end at the
    # same one (rank 1 stalled before step 6 issued any; rank 0 ended in the liveness check, on a group of its own)
    assert out.count(f"flight recorder: {tmp_path / 'flight_recorder'}/rank_") == 2, out[-3000:]
    last_issued = {}
    for rank in (0, 1):
        record = pickle.loads((tmp_path / "flight_recorder" / f"rank_{rank}").read_bytes())
        issued = [e for e in record["entries"] if e["process_group"][1] == "default_pg"]
        assert issued and all(e["profiling_name"].startswith("gloo:") for e in issued), record["entries"][-3:]
        last_issued[rank] = max(e["collective_seq_id"] for e in issued)
    assert last_issued[0] == last_issued[1] > 0, last_issued

    code, out = run_torchrun(tmp_path, "resilience.liveness_every_steps=1", "resilience.liveness_timeout_s=30")
    assert code == 0, out[-3000:]
    assert resumed_from(out) == 4
    assert losses(tmp_path) == reference  # the liveness rounds change nothing either


def test_random_sigkills_of_one_rank_resume_bitwise(tmp_path, reference):
    """SIGKILL one rank at a random moment: the other names it and exits 77; a resume reproduces the curve."""
    rng = random.Random(4321)
    root = tmp_path / "checkpoints"
    victims = []
    for kill in range(KILLS):
        done = max(losses(tmp_path), default=0)
        if done >= STEPS - 2:
            break
        window = max(1, (STEPS - 3 - done) // (KILLS - kill))  # spread the kills over the run
        launcher = start(tmp_path)
        wait_for_step(launcher, tmp_path, rng.randint(done + 1, done + window))
        time.sleep(rng.uniform(0.0, 0.3))  # inside a step or inside a checkpoint write
        victim = rng.randint(0, 1)
        os.kill(worker_pid(launcher, victim), signal.SIGKILL)
        code, out = finish(launcher)
        assert code != 0, out[-3000:]
        assert "Signal 9 (SIGKILL)" in out, out[-3000:]
        survivor = f"rank {1 - victim}: a collective failed at step "
        assert survivor in out and f"rank {victim} did not answer a liveness check" in out, out[-3000:]
        assert f"exitcode  : {EXIT_PEER_LOST}" in out
        assert_sealed_checkpoints_are_whole(root)
        victims.append(victim)
    last_sealed = latest_checkpoint(root)  # None when every kill came before the first save
    code, out = run_torchrun(tmp_path)
    assert code == 0, out[-3000:]
    assert ("resumed from" in out) == (last_sealed is not None)
    if last_sealed is not None:
        assert resumed_from(out) == step_of(last_sealed)
    print(f"survived {len(victims)} random SIGKILLs (of ranks {victims}) with an identical loss curve")
    assert losses(tmp_path) == reference


def test_a_sigkill_during_an_async_write_leaves_the_previous_checkpoint_latest(tmp_path, reference):
    """Rank 1 is killed while its asynchronous write of a checkpoint has not finished: that checkpoint is never
    sealed, the one before stays `latest`, and the resumed job reproduces the uninterrupted curve."""
    root = tmp_path / "checkpoints"
    launcher = start(tmp_path, "checkpoint.async_mode=async")
    killed, deadline = None, time.monotonic() + 240
    while killed is None and launcher.poll() is None and time.monotonic() < deadline:
        for folder in sorted(root.glob("step-*")) if root.is_dir() else []:
            if step_of(folder) >= 4 and not (folder / "COMPLETE").exists() and not (folder / ".done-rank1").exists():
                os.kill(worker_pid(launcher, 1), signal.SIGKILL)  # its write of `folder` is still in flight
                killed = folder
                break
        time.sleep(0.002)
    code, out = finish(launcher)
    assert killed is not None, out[-3000:]
    assert code != 0 and "exitcode  : -9" in out, out[-3000:]  # rank 1's SIGKILL ends the job
    # Rank 0 names rank 1 and exits 77 when its next collective fails first; torchrun's teardown (a SIGTERM to the
    # survivors as soon as it sees rank 1 die, then SIGKILL after 30 s) may end it before. Either way the job
    # fails; this test is about the checkpoint in flight (exit 77: test_random_sigkills_of_one_rank_resume_bitwise).
    assert f"exitcode  : {EXIT_PEER_LOST}" in out or "Sending process" in out, out[-3000:]
    assert not (killed / "COMPLETE").exists()
    latest = latest_checkpoint(root)
    assert latest is not None and step_of(latest) == step_of(killed) - 2, (latest, killed)
    assert_sealed_checkpoints_are_whole(root)
    code, out = run_torchrun(tmp_path, "checkpoint.async_mode=async")
    assert code == 0, out[-3000:]
    assert resumed_from(out) == step_of(latest)
    assert losses(tmp_path) == reference
