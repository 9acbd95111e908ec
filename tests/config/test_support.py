"""The support matrix (forge.config.support): docs/reference/support.md is current, every refused cell is one line,
and every supported cell of 1 or 2 ranks trains two steps on real gloo ranks and matches one process: the same
model and features with the layout taken away and the cell's micro-batch. The cells of 4 and 8 ranks each run in a
process group of their own: one trainer per process group, as in a real run.
"""

import math
from pathlib import Path

import pytest

from forge.config.support import FEATURES, KINDS, SMALL, cell_overrides, page_path, render, support_matrix
from tests.parallel.harness import launch

TWO_STEPS = ["train.steps=2", "scheduler.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1"]

LAYOUT_KEYS = tuple(
    f"parallel.{key}=" for key in ("tp", "cp", "pp", "ep", "dp_shard", "dp_replicate", "ep_spans_tp", "pp_schedule")
) + ("parallel=",)
"""Overrides that choose the layout; a cell without them is its one-process twin."""

RTOL = 1e-4
"""fp32: the ranks' reductions run in another order than one process's (measured differences ~1e-6)."""
COMPILE_RTOL = 1e-3
"""inductor fuses and reorders the fp32 arithmetic."""
FP8_RTOL = 2e-3
"""bf16 with float8 matmuls: the ranks' partial sums round to bf16 in another order (the loss)."""
BF16_GRAD_RTOL = 2**-7
"""The first step's grad norm of bf16 gradients: two of bf16's relative spacings (2**-8), each element rounded after
sums in another order. (The second step's is not compared: its weights are one bf16-rounded update apart, and an MoE
token whose expert that flips moves the norm by percents: 2.5 % measured for fp8 x tp2 with balanced selection.)"""

SAME_ARITHMETIC = {
    "activation checkpointing (full)": RTOL,
    "activation checkpointing (selective)": RTOL,
    "compile": COMPILE_RTOL,
    "flex attention": RTOL,
}
"""One-process features that change how, not what, the model computes: they match the run without them. (fp8 and
document masking change what is computed: in one process they are their own reference and only must train.)"""


SWITCH_OFF_BALANCED_SELECTION = ["model.moe.balanced_selection=false"]
"""For MoE cells with context parallelism, in the cell and its twin: each cp rank routes half of every sequence, and
the presets' balanced selection is solved on the tokens a layer routes, so it picks other experts than one process
(tests/parallel/test_moe_layouts.py turns it off too); the sign-balanced routing then matches one process."""


def cell_runs(feature: str, kind: str) -> list[str]:
    overrides = cell_overrides(feature, kind)
    with_cp = any(o in ("parallel=cp2", "parallel=cp2_fsdp", "parallel.cp=2") for o in overrides)
    return overrides + (SWITCH_OFF_BALANCED_SELECTION if kind == "MoE" and with_cp else [])


@pytest.fixture(scope="module")
def matrix() -> dict:
    return support_matrix()


def micro_batch(overrides: list[str], world: int) -> int:
    """The batch one forward of the cell holds on its world: the micro-batch validation fills in, which a pipeline
    splits into its microbatches (forge.parallel.pipeline)."""
    from forge.config import compose, validate

    cfg = compose(overrides)
    degrees = validate(cfg, world_size=world)
    return cfg.train.micro_batch_size // ((cfg.parallel.microbatches or degrees.pp) if degrees.pp > 1 else 1)


def one_process_twin(feature: str, kind: str) -> tuple[list[str], dict[str, tuple[float, int]]] | None:
    """The one-process run a supported cell must match, and each curve's tolerance and steps compared (None: the
    cell is its own reference).
    The twin keeps the cell's batch per forward: a micro-batch-scoped MoE balancing loss is each micro-batch's own,
    so one process accumulates the micro-batches (or pipeline chunks) the ranks hold."""
    world = FEATURES[feature].world
    overrides = cell_runs(feature, kind)
    if world == 1:
        if feature not in SAME_ARITHMETIC:
            return None
        return [*KINDS[kind], *SMALL], dict.fromkeys(("loss", "grad_norm"), (SAME_ARITHMETIC[feature], 2))
    twin = [o for o in overrides if not o.startswith(LAYOUT_KEYS)]
    twin += ["parallel=single", f"train.micro_batch_size={micro_batch(overrides, world)}"]
    if "parallel.fp8=true" in overrides:
        return twin, {"loss": (FP8_RTOL, 2), "grad_norm": (BF16_GRAD_RTOL, 1)}
    return twin, dict.fromkeys(("loss", "grad_norm"), (RTOL, 2))


def supported_cells(matrix: dict, world: int) -> dict[str, list[str]]:
    return {
        f"{feature}|{kind}": cell_runs(feature, kind)
        for (feature, kind), state in matrix.items()
        if state is None and FEATURES[feature].world == world
    }


def train_runs(runs: dict[str, list[str]], root: str) -> dict[str, dict[str, list[float]]]:
    """Two steps of each run on this rank's process group, one after another; rank 0 returns their curves."""
    from forge.config import compose
    from forge.parallel.dist import is_main_process
    from forge.train.trainer import Trainer
    from forge.train.vlm_trainer import VLMTrainer
    from tests.parallel.scenarios import curves

    out = {}
    for name, overrides in runs.items():
        cfg = compose([*overrides, *TWO_STEPS, "train.threads=1", "train.log_every=1"])
        trainer = (VLMTrainer if cfg.get("vlm") is not None else Trainer)(cfg, Path(root) / f"run_{len(out)}")
        trainer.fit()
        out[name] = curves(trainer.run_dir) if is_main_process() else {}
    return out


@pytest.fixture(scope="module")
def one_process(matrix, tmp_path_factory) -> dict[tuple[str, ...], dict[str, list[float]]]:
    """Every one-process run the tests compare with, each once: the world-1 cells and the cells' twins."""
    runs = [overrides for overrides in supported_cells(matrix, 1).values()]
    for (feature, kind), state in matrix.items():
        if state is None and (twin := one_process_twin(feature, kind)):
            runs.append(twin[0])
    unique = {"|".join(overrides): overrides for overrides in runs}
    curves = launch(train_runs, 1, unique, str(tmp_path_factory.mktemp("one")), timeout=900)[0]
    return {tuple(key.split("|")): run for key, run in curves.items()}


def assert_trains_like_its_twin(cell: str, run: dict, one_process: dict) -> None:
    feature, kind = cell.split("|")
    assert len(run["loss"]) == 2 and all(math.isfinite(x) and x > 0 for x in run["loss"] + run["grad_norm"]), run
    twin = one_process_twin(feature, kind)
    if twin is None:
        return
    want = one_process[tuple(twin[0])]
    for key in ("loss", "grad_norm"):
        rel, steps = twin[1][key]
        got, one = run[key][:steps], want[key][:steps]
        assert got == pytest.approx(one, rel=rel), f"{cell}: {key} {got} vs one process {one}"


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


ONE_GROUP_PER_CELL_FROM = 4
"""Worlds from which each cell gets a process group of its own. (Several trainers of those layouts one after another
in one forked process group once failed in the suite to resolve a process group of an earlier mesh; one trainer per
process group, as in a real run, does not.)"""


@pytest.mark.dist
def test_every_one_process_cell_trains_and_matches_the_run_without_its_feature(matrix, one_process):
    cells = supported_cells(matrix, 1)
    assert cells
    for cell, overrides in cells.items():
        assert_trains_like_its_twin(cell, one_process[tuple(overrides)], one_process)


@pytest.mark.dist
@pytest.mark.parametrize("world", sorted({feature.world for feature in FEATURES.values()} - {1}))
def test_every_supported_cell_matches_one_process(matrix, world, one_process, tmp_path):
    """All supported cells of one world size, each against its one-process twin."""
    cells = supported_cells(matrix, world)
    if world < ONE_GROUP_PER_CELL_FROM:
        runs = launch(train_runs, world, cells, str(tmp_path), timeout=900)[0]
    else:
        runs = {}
        for i, (cell, overrides) in enumerate(cells.items()):
            runs |= launch(train_runs, world, {cell: overrides}, str(tmp_path / str(i)), timeout=600)[0]
    assert sorted(runs) == sorted(cells)
    for cell, run in runs.items():
        assert_trains_like_its_twin(cell, run, one_process)
