"""q/k norms under tensor parallelism: each rank norms its own heads, the shared norm weights get the gradient
summed over every rank's heads, and TP 2 (with and without accumulation) trains like one process; also with a
model.head_dim that sets the heads' width apart from dim / n_heads (Qwen3's 128 x heads != dim)."""

import pytest

from tests.parallel.harness import launch
from tests.parallel.scenarios import run_scenarios

pytestmark = pytest.mark.dist

QK = ["model.qk_norm=true"]
WIDE_HEADS = ["model.head_dim=32"]  # 4 heads of 32 on a width of 64: q is 128 wide, wo maps 128 -> 64
RTOL = 1e-4  # fp32; the sharded reductions only reorder sums


@pytest.mark.slow
def test_tp2_with_qk_norm_matches_one_process(tmp_path):
    single = ["parallel=single", "train.micro_batch_size=8"]
    references = {"one": [*QK, *single], "one_wide": [*QK, *WIDE_HEADS, *single]}
    one = launch(run_scenarios, 1, references, str(tmp_path / "a"))[0]
    layouts = {
        "tp2": ("one", [*QK, "parallel=tp2", "train.micro_batch_size=8"]),
        "tp2_accum": ("one", [*QK, "parallel=tp2", "train.micro_batch_size=4"]),
        "tp2_wide": ("one_wide", [*QK, *WIDE_HEADS, "parallel=tp2", "train.micro_batch_size=8"]),
    }
    two = launch(run_scenarios, 2, {name: overrides for name, (_, overrides) in layouts.items()}, str(tmp_path / "b"))
    assert one["one"]["loss"][-1] < one["one"]["loss"][0]
    assert one["one_wide"]["params"] > one["one"]["params"]  # the wider heads took effect
    for name, got in two[0].items():
        want = one[layouts[name][0]]
        assert got["wq_placements"] == ["S(0)"]
        for key in ("loss", "grad_norm", "val_loss"):
            assert got[key] == pytest.approx(want[key], rel=RTOL), (name, key)
