"""Liveness rounds and the lost-peer exit between real forked gloo ranks: one rank sleeps or dies."""

import logging
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from forge.config.schema import ResilienceConfig
from forge.resilience.guard import StepGuard
from forge.resilience.liveness import EXIT_PEER_LOST, Liveness, PeerLostError
from tests.faults.ranks import fork_ranks

pytestmark = pytest.mark.dist


def _stall_until(flag: Path, limit_s: float = 60.0) -> bool:
    """A stalled rank: sleeps until the healthy rank reports (True) or the limit passes (False)."""
    deadline = time.monotonic() + limit_s
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return flag.exists()


def _all_arrive(rank: int) -> list:
    live = Liveness(timeout_s=30, every_steps=2)
    for step in range(1, 5):
        live.check(step)  # steps 2 and 4 run a round; every rank is there
    return live.missing_ranks()


def test_liveness_rounds_pass_when_every_rank_arrives():
    results = fork_ranks(_all_arrive, 2, collective_timeout_s=30)
    assert results == {0: (0, []), 1: (0, [])}


def _rank1_sleeps_through_check(rank: int, flag: Path):
    live = Liveness(timeout_s=1, every_steps=3)
    live.check(1)  # not due: returns without a round
    if rank == 1:
        return _stall_until(flag)
    try:
        live.check(3)
    except PeerLostError as err:
        return str(err)
    finally:
        flag.touch()
    return "no error"


def test_the_periodic_check_names_a_sleeping_rank_while_it_still_sleeps(tmp_path):
    results = fork_ranks(_rank1_sleeps_through_check, 2, tmp_path / "reported", collective_timeout_s=30)
    code, message = results[0]
    assert code == 0
    assert message.startswith("liveness check at step 3: rank 1 did not reach it within 1 s"), message
    assert results[1] == (0, True)  # rank 0 reported while rank 1 was still stalled


def _rank1_dies(rank: int):
    live = Liveness(timeout_s=30, every_steps=1)
    if rank == 1:
        os._exit(9)
    with pytest.raises(PeerLostError, match="liveness check at step 1: rank 1 did not reach it") as err:
        live.check(1)  # a dead peer is named at once, not after the 30 s timeout
    return str(err.value)


def test_a_dead_rank_is_named():
    results = fork_ranks(_rank1_dies, 2, collective_timeout_s=30)
    assert results[1] == (9, None)
    assert results[0][0] == 0, results[0][1]


def _rank0_stalls(rank: int, flag: Path):
    live = Liveness(timeout_s=1, every_steps=1)
    if rank == 0:
        return _stall_until(flag)
    try:
        live.check(5)
    except PeerLostError as err:
        return str(err)
    finally:
        flag.touch()
    return "no error"


def test_other_ranks_name_rank_0_when_it_stalls(tmp_path):
    results = fork_ranks(_rank0_stalls, 2, tmp_path / "reported", collective_timeout_s=30)
    assert results[0] == (0, True)
    code, message = results[1]
    assert code == 0 and "liveness check at step 5: rank 0 did not reach it" in message, message


def _guard(**overrides) -> StepGuard:
    cfg = OmegaConf.structured(ResilienceConfig(watchdog_factor=0, preemption_signals=[], **overrides))
    return StepGuard(cfg)


def _collective_times_out(rank: int, log_file: Path, flag: Path):
    """Rank 1 stalls inside step 4; rank 0's all-reduce times out and the guard ends it with one clear error."""
    logging.getLogger("forge").addHandler(logging.FileHandler(log_file))
    guard = _guard(liveness_timeout_s=1)
    guard.step_started(4)
    if rank == 1:
        return _stall_until(flag)
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError as err:
        flag.touch()
        guard.exit_if_peer_lost(err)  # leaves the process with EXIT_PEER_LOST
    return "returned"


def test_a_timed_out_collective_names_the_stalled_rank_and_exits_77(tmp_path):
    log_file = tmp_path / "rank0.log"
    results = fork_ranks(_collective_times_out, 2, log_file, tmp_path / "reported", collective_timeout_s=2)
    assert results[0] == (EXIT_PEER_LOST, None)
    assert results[1] == (0, True)
    message = log_file.read_text()
    assert "rank 0: a collective failed at step 4 (" in message
    assert "Timed out waiting" in message
    assert "rank 1 did not answer a liveness check within 1 s (stalled or dead)" in message
    assert "ending the job (exit code 77)" in message


def _other_errors_pass_through(rank: int):
    guard = _guard()
    guard.step_started(1)
    guard.exit_if_peer_lost(ValueError("a bug, not a lost peer"))
    dist.barrier()  # rank 0 serves the store the guard wrote to: it must not leave first
    return "returned"


def test_other_errors_are_left_to_the_caller():
    assert fork_ranks(_other_errors_pass_through, 2, collective_timeout_s=30) == {
        0: (0, "returned"),
        1: (0, "returned"),
    }


def progress_of_rank(rank: int, rank_behind: int) -> tuple[str, list[str]]:
    """Every rank reports its started steps on the board; `rank_behind` stops one step short. Returns the report
    and the threads that wrote to the store."""
    import threading

    from forge.resilience.progress import ProgressBoard

    writers: list[str] = []

    class Recording:
        def __init__(self, store):
            self.store = store

        def set(self, key, value):
            writers.append(threading.current_thread().name)
            self.store.set(key, value)

        def __getattr__(self, name):
            return getattr(self.store, name)

    client = ProgressBoard.client
    ProgressBoard.client = lambda board: Recording(client(board))
    board = ProgressBoard()
    last = 5 if rank == rank_behind else 6
    for step in range(1, last + 1):
        board.started(step)
    assert board.flush()  # the board's thread wrote it
    dist.barrier()
    report = board.report()
    dist.barrier()  # rank 0 serves the store: it must not leave while another rank still reads
    return report, sorted(set(writers))


def test_the_progress_board_names_the_rank_that_did_not_start_the_step():
    """What a firing watchdog adds to its message: read from the job's store, no collective involved. The
    training thread only records its step: the board's own thread writes it (no store round trip in a step)."""
    results = fork_ranks(progress_of_rank, 3, 1, collective_timeout_s=30)
    want = "last started step per rank: 0: 6, 1: 5, 2: 6; rank 1 did not start step 6 (stalled or dead before it)"
    assert results == {rank: (0, (want, ["forge-progress"])) for rank in range(3)}


def test_progress_described_when_nobody_is_behind_or_nothing_started():
    from forge.resilience.progress import describe

    assert "every rank started step 4, so the stall is inside it" in describe({0: 4, 1: 4})
    assert describe({0: None, 1: 3}).endswith("rank 0 did not start step 3 (stalled or dead before it)")
    assert describe({0: None, 1: None}) == "last started step per rank: 0-1: -"


def test_progress_of_512_ranks_fits_one_short_line():
    """At scale the report groups runs of ranks at the same step: one stalled rank of 512 is named in a line of
    a few dozen characters, not 512 entries."""
    from forge.resilience.progress import describe

    steps: dict[int, int | None] = {rank: 1200 for rank in range(512)}
    steps[256] = 1199
    steps[300] = steps[301] = None
    assert describe(steps) == (
        "last started step per rank: 0-255: 1200, 256: 1199, 257-299: 1200, 300-301: -, 302-511: 1200; "
        "ranks 256, 300-301 did not start step 1200 (stalled or dead before it)"
    )
