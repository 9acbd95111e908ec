"""The support matrix (forge.config.support): docs/reference/support.md is current, every refused cell is one line,
and every supported cell trains two steps on its smallest world (1 to 8 forked gloo ranks) with the transforms it
names applied. A cell of several ranks matches one process: the same model and features without the layout, at the
cell's batch per forward. Checkpointing, compile and flex attention in one process match the run without them; fp8
and document masking in one process change what is computed and only must train. The cells of 4 and 8 ranks each
run in a process group of their own: one trainer per process group, as in a real run.
"""

import functools
import logging
import math
from pathlib import Path

import pytest

from forge.config.degrees import pipeline_chunks
from forge.config.support import FEATURES, KINDS, SMALL, cell_overrides, page_path, render, support_matrix
from tests.parallel.harness import launch

TWO_STEPS = ["train.steps=2", "scheduler.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1"]
"""Each run's length: the second step's loss and grad norm follow the first update, so a wrong gradient shows."""

LAYOUT_KEYS = tuple(
    f"parallel.{key}=" for key in ("tp", "cp", "pp", "ep", "dp_shard", "dp_replicate", "ep_spans_tp", "pp_schedule")
) + ("parallel=",)
"""Overrides that choose the layout; a cell without them is its one-process twin."""

RTOL = 1e-4
"""fp32: the ranks' reductions run in another order than one process's (measured differences ~1e-6)."""
COMPILE_RTOL = 1e-3
"""inductor fuses and reorders the fp32 arithmetic."""
FP8_RTOL = 2e-3
"""bf16 with float8 matmuls, the loss: the ranks' partial sums round to bf16 in another order (measured for fp8 x tp2:
3e-4 for the MoE, 1e-3 dense)."""
BF16_GRAD_RTOL = 2**-7
"""bf16 gradients, the first step's grad norm: one bf16 spacing (2**-7 relative, twice its unit roundoff), each
element rounded after sums in another order (measured: 1.7e-3 dense, 7e-5 MoE). The second step's is not compared:
its weights are one bf16-rounded update apart (dense: 4.6e-3 measured)."""

SAME_ARITHMETIC = {
    "activation checkpointing (full)": RTOL,
    "activation checkpointing (selective)": RTOL,
    "compile": COMPILE_RTOL,
    "flex attention": RTOL,
}
"""One-process features that change how, not what, the model computes: they match the run without them. (fp8 and
document masking change what is computed: in one process they are their own reference and only must train.)"""

APPLIED = {
    "dp_replicate (DDP)": {"fsdp"},
    "dp_shard (FSDP)": {"fsdp"},
    "HSDP": {"fsdp"},
    "tp": {"tp"},
    "pp": {"pp"},
    "cp": {"cp"},
    "ep": {"ep", "fsdp"},
    "fp8": {"fp8"},
    "activation checkpointing (full)": {"activation_checkpoint"},
    "activation checkpointing (selective)": {"activation_checkpoint"},
    "compile": {"compile"},
    "flex attention": set(),  # a kernel of the model's own (model.attention), no transform
    "document masking": set(),  # the data's document ids, no transform
    "zero-bubble pp (zbv) x FSDP": {"pp", "fsdp"},
    "tp x pp x FSDP": {"tp", "pp", "fsdp"},
    "tp x cp x pp": {"tp", "cp", "pp"},
    "pp x ep x FSDP": {"pp", "ep", "fsdp"},
    "tp x ep": {"tp", "ep", "fsdp"},
    "ep spanning tp": {"tp", "ep"},
    "cp x ep": {"cp", "ep", "fsdp"},
    "ep x activation checkpointing (selective)": {"ep", "activation_checkpoint"},
    "fp8 x tp": {"fp8", "tp"},
}
"""The parallel plan's steps (forge.parallel.applied) each feature's cell must have applied: a transform skipped by
mistake would leave a run that still matches its twin."""

SWITCH_OFF_BALANCED_SELECTION = ["model.moe.balanced_selection=false"]
"""For MoE cells of several ranks that route other tokens, or round them otherwise, than one process: each cp rank
routes half of every sequence, and a bf16 rank's partial sums flip a token's expert (fp8 x tp2: grad norm 2.5 % off
at step 2 with balanced selection, 0.4 % without). The presets' balanced selection, solved on the tokens a layer
routes, moves a whole token at such an edge; the cell and its twin turn it off (as tests/parallel/test_moe_layouts.py
does for cp), and the sign-balanced routing then matches one process."""


@functools.cache
def resolved(overrides: tuple[str, ...], world: int):
    """The cell's config as validation resolves it on its world, and its degrees."""
    from forge.config import compose, validate

    cfg = compose(list(overrides))
    return cfg, validate(cfg, world_size=world)


def overrides_as_tested(feature: str, kind: str) -> list[str]:
    """The cell's overrides, with balanced selection off where one process cannot route as the ranks do."""
    overrides = cell_overrides(feature, kind)
    cfg, degrees = resolved(tuple(overrides), FEATURES[feature].world)
    low_precision_ranks = degrees.world_size > 1 and cfg.train.dtype != "fp32"
    off = kind == "MoE" and (degrees.cp > 1 or low_precision_ranks)
    return overrides + (SWITCH_OFF_BALANCED_SELECTION if off else [])


@pytest.fixture(scope="module")
def matrix() -> dict:
    return support_matrix()


def batch_per_forward(overrides: list[str], world: int) -> int:
    """The batch one forward of the cell holds on its world: the micro-batch validation fills in, which a pipeline
    splits into its microbatches (forge.parallel.pipeline)."""
    cfg, degrees = resolved(tuple(overrides), world)
    return cfg.train.micro_batch_size // pipeline_chunks(degrees.pp, cfg.parallel.microbatches)


def one_process_twin(feature: str, kind: str) -> tuple[list[str], dict[str, tuple[float, int]]] | None:
    """The one-process run a supported cell must match, and each curve's tolerance and steps compared (None: the
    cell is its own reference).
    The twin keeps the cell's batch per forward: a micro-batch-scoped MoE balancing loss is each micro-batch's own,
    so one process accumulates the micro-batches (or pipeline chunks) the ranks hold."""
    world = FEATURES[feature].world
    overrides = overrides_as_tested(feature, kind)
    if world == 1:
        if feature not in SAME_ARITHMETIC:
            return None
        return [*KINDS[kind], *SMALL], dict.fromkeys(("loss", "grad_norm"), (SAME_ARITHMETIC[feature], 2))
    twin = [o for o in overrides if not o.startswith(LAYOUT_KEYS)]
    twin += ["parallel=single", f"train.micro_batch_size={batch_per_forward(overrides, world)}"]
    if "parallel.fp8=true" in overrides:
        return twin, {"loss": (FP8_RTOL, 2), "grad_norm": (BF16_GRAD_RTOL, 1)}
    return twin, dict.fromkeys(("loss", "grad_norm"), (RTOL, 2))


def supported_cells(matrix: dict, world: int) -> dict[str, list[str]]:
    return {
        f"{feature}|{kind}": overrides_as_tested(feature, kind)
        for (feature, kind), state in matrix.items()
        if state is None and FEATURES[feature].world == world
    }


class PlanSteps(logging.Handler):
    """Collects the steps of the parallel plan as forge.parallel.applied logs them."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.steps: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        step = getattr(record, "plan_step", None)
        if step is not None:
            self.steps.add(step)


def train_runs(runs: dict[str, list[str]], root: str) -> dict[str, dict]:
    """Two steps of each run on this rank's process group, one after another; rank 0 returns their curves and the
    plan's steps."""
    from forge.config import compose
    from forge.parallel.dist import is_main_process
    from forge.train.trainer import Trainer
    from forge.train.vlm_trainer import VLMTrainer
    from tests.parallel.scenarios import curves

    log = logging.getLogger("forge")
    log.setLevel(logging.INFO)  # the plan logs its steps at INFO (the trainer quiets the other ranks itself)
    out = {}
    for name, overrides in runs.items():
        cfg = compose([*overrides, *TWO_STEPS, "train.threads=1", "train.log_every=1"])
        steps = PlanSteps()
        log.addHandler(steps)
        try:
            trainer = (VLMTrainer if cfg.get("vlm") is not None else Trainer)(cfg, Path(root) / f"run_{len(out)}")
        finally:
            log.removeHandler(steps)
        trainer.fit()
        out[name] = curves(trainer.run_dir) | {"plan": steps.steps} if is_main_process() else {}
    return out


@pytest.fixture(scope="module")
def one_process(matrix, tmp_path_factory) -> dict[tuple[str, ...], dict]:
    """Every one-process run the tests compare with, each once: the world-1 cells and the cells' twins (about 50
    runs, 3 of them compiled: 2 minutes here)."""
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
    assert APPLIED[feature] <= run["plan"], f"{cell}: the plan applied {sorted(run['plan'])}"
    twin = one_process_twin(feature, kind)
    if twin is None:
        return
    want = one_process[tuple(twin[0])]
    for key in ("loss", "grad_norm"):
        rel, steps = twin[1][key]
        got, one = run[key][:steps], want[key][:steps]
        assert got == pytest.approx(one, rel=rel), f"{cell}: {key} {got} vs one process {one}"


def test_every_feature_names_the_plan_steps_it_applies():
    assert set(APPLIED) == set(FEATURES)


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
"""Worlds from which each cell gets a process group of its own, as in a real run. (A cell once failed to resolve a
process group of an earlier mesh: DTensor's caches kept results on an equal mesh of an earlier process group;
forge.parallel.mesh.build_mesh now drops them, tests/parallel/test_mesh_and_plan.py guards it.)"""


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
