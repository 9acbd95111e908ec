"""forge.parallel.dist with real gloo ranks: local rank 0 first, and its failure reaching the waiting ranks."""

import time

import pytest

from tests.parallel.harness import launch

pytestmark = pytest.mark.dist


def first_fails(_: int) -> dict:
    import os

    from forge.parallel.dist import local_rank_zero_first

    rank = int(os.environ["RANK"])
    start = time.monotonic()
    try:
        with local_rank_zero_first():
            if rank == 0:
                raise OSError("cache folder not writable")
    except (OSError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def both_succeed(_: int) -> list[str]:
    import os

    from forge.parallel.dist import local_rank_zero_first

    order = []
    with local_rank_zero_first():
        order.append(f"rank {os.environ['RANK']} body at {time.monotonic():.6f}")
    return order


def test_a_failing_local_rank_zero_stops_the_waiting_rank_at_once():
    zero, one = launch(first_fails, 2, 0, timeout=60)
    assert zero["error"] == "OSError: cache folder not writable"
    assert one["error"] is not None and "local rank 0 failed" in one["error"]
    assert one["seconds"] < 30  # not the collective timeout


def test_ranks_run_after_local_rank_zero():
    zero, one = launch(both_succeed, 2, 0, timeout=60)
    assert float(zero[0].split()[-1]) < float(one[0].split()[-1])
