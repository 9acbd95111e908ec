"""The support matrix (forge.config.support): docs/reference/support.md is current, every refused cell is one line,
and every supported cell of 1 or 2 ranks builds and trains a step (real gloo ranks; the larger worlds' cells:
ELSEWHERE).

Which supported layouts also match one process, and how closely, is tested per layout in tests/parallel/.
"""

import math
from pathlib import Path

import pytest

from forge.config.support import FEATURES, cell_overrides, page_path, render, support_matrix
from tests.parallel.harness import launch

ONE_STEP = ["train.steps=1", "scheduler.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1"]


@pytest.fixture(scope="module")
def matrix() -> dict:
    return support_matrix()


def test_the_page_is_current(matrix):
    assert page_path().read_text() == render(matrix), "run: python -m forge.config.support"


def test_refusals_are_one_line_and_some_cells_of_each_kind_are_supported(matrix):
    refused = {cell: why for cell, why in matrix.items() if why is not None}
    assert all("\n" not in why and why for why in refused.values()), refused
    for kind in ("dense", "MoE", "MLA", "VLM"):
        assert any(state is None for (_, k), state in matrix.items() if k == kind), kind
    # the layouts large runs use
    for cell in (("tp x pp x FSDP", "dense"), ("tp x cp x pp", "dense"), ("pp x ep x FSDP", "MoE"), ("tp", "MoE")):
        assert matrix[cell] is None, cell


def train_cells(cells: dict[str, list[str]], root: str) -> dict[str, float]:
    """One step of each cell on this rank's process group; the step's loss."""
    from forge.config import compose
    from forge.parallel.dist import is_main_process
    from forge.train.trainer import Trainer
    from forge.train.vlm_trainer import VLMTrainer
    from tests.parallel.scenarios import curves

    losses = {}
    for name, overrides in cells.items():
        cfg = compose([*overrides, *ONE_STEP, "train.threads=1", "train.log_every=1"])
        trainer = (VLMTrainer if cfg.get("vlm") is not None else Trainer)(cfg, Path(root) / name.replace(" ", "_"))
        trainer.fit()
        losses[name] = curves(trainer.run_dir)["loss"][0] if is_main_process() else 0.0
    return losses


ELSEWHERE = {
    4: "HSDP in tests/parallel/test_parity.py, pp2 x ep2 and zbv x FSDP in test_pipeline.py, tp2 x ep2 in "
    "test_moe_layouts.py",
    8: "tests/parallel/test_pipeline.py's tp2 x pp2 x FSDP 2 and tp2 x cp2 x pp2, against one process",
}
"""Worlds whose cells run in other tests. (Several trainers of those layouts one after another in one forked
process group once failed in the suite to resolve a process group of an earlier mesh; one trainer per process,
as in a real run, does not.)"""


@pytest.mark.dist
@pytest.mark.parametrize("world", sorted({feature.world for feature in FEATURES.values()} - set(ELSEWHERE)))
def test_every_supported_cell_trains_a_step(matrix, world, tmp_path):
    """All supported cells of one world size in one process group, one after another."""
    cells = {
        f"{feature}|{kind}": cell_overrides(feature, kind)
        for (feature, kind), state in matrix.items()
        if state is None and FEATURES[feature].world == world
    }
    losses = launch(train_cells, world, cells, str(tmp_path), timeout=600)[0]
    assert sorted(losses) == sorted(cells)
    assert all(math.isfinite(loss) and loss > 0 for loss in losses.values()), losses
