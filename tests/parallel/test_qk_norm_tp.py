"""q/k norms under tensor parallelism: each rank norms its own heads, the shared norm weights get the gradient
summed over every rank's heads, and TP 2 (with and without accumulation) trains like one process."""

import pytest

from tests.parallel.harness import launch
from tests.parallel.scenarios import run_scenarios

pytestmark = pytest.mark.dist

QK = ["model.qk_norm=true"]
RTOL = 1e-4  # fp32; the sharded reductions only reorder sums


@pytest.mark.slow
def test_tp2_with_qk_norm_matches_one_process(tmp_path):
    one = launch(run_scenarios, 1, {"one": [*QK, "parallel=single", "train.micro_batch_size=8"]}, str(tmp_path / "a"))
    layouts = {
        "tp2": [*QK, "parallel=tp2", "train.micro_batch_size=8"],
        "tp2_accum": [*QK, "parallel=tp2", "train.micro_batch_size=4"],
    }
    two = launch(run_scenarios, 2, layouts, str(tmp_path / "b"))[0]
    want = one[0]["one"]
    assert want["loss"][-1] < want["loss"][0]
    for name, got in two.items():
        for key in ("loss", "grad_norm", "val_loss"):
            assert got[key] == pytest.approx(want[key], rel=RTOL), (name, key)
