"""The straggler report's arithmetic, and the stage groups it compares: no processes (the two-rank report runs in
tests/faults/test_multirank.py)."""

import random
import statistics
import subprocess
import sys

from forge.resilience.stragglers import StragglerClock, median_without


def test_median_without_one_value_equals_the_median_of_the_rest():
    rng = random.Random(0)
    for _ in range(500):
        times = sorted(rng.randint(0, 9) for _ in range(rng.randint(2, 12)))
        value = rng.choice(times)
        rest = list(times)
        rest.remove(value)
        assert median_without(times, value) == statistics.median(rest), (times, value)


def report(busy_us: list[int], groups: list[list[int]], factor: float = 1.5) -> dict:
    clock = StragglerClock(factor, rank=0, groups=groups)
    clock.observe(busy_us)
    return clock.metrics()


def test_a_rank_is_compared_with_the_others_of_its_pipeline_stage():
    stages = [[0, 1, 2], [3, 4, 5]]
    # the second stage works twice as long by design: nobody is slow
    assert report([10, 10, 11, 20, 21, 20], stages)["straggler_ranks"] == []
    slow = report([10, 10, 11, 20, 41, 20], stages)
    assert slow["straggler_ranks"] == [4] and slow["busy_time_max_over_median"] == 41 / 20
    assert report([10, 10, 11, 20, 41, 20], [list(range(6))])["straggler_ranks"] == [3, 4, 5]  # one group: stages
    assert report([10, 30], [[0, 1]])["straggler_ranks"] == [1]  # two ranks: each against the other
    assert not StragglerClock(0, 0, [[0, 1]]).enabled and not StragglerClock(1.5, 0, [[0]]).enabled


STAGES = """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from forge.parallel.mesh import stage_groups
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "pp", "tp"))
print(stage_groups(mesh, 8), stage_groups(init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)), 8))
"""


def test_stage_groups_hold_the_ranks_of_one_pipeline_stage():
    out = subprocess.run([sys.executable, "-c", STAGES], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[[0, 1, 4, 5], [2, 3, 6, 7]] [[0, 1, 2, 3, 4, 5, 6, 7]]"
