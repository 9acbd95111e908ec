"""Tied input and output embeddings stay one parameter under TP, TP x FSDP and FSDP, and train like one process.

Under pipeline parallelism (pp2, pp2 x fsdp2) the first and the last stage each hold the matrix: both start and
stay bitwise equal, and the run follows one process.
"""

import hashlib
from pathlib import Path

import pytest
from torch.distributed.tensor import DTensor

from forge.config import compose
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY, curves

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TIED = ["model.tie_embeddings=true"]
LAYOUTS = {"tp2": ["parallel=tp2"], "fsdp2": ["parallel=fsdp"], "pp2": ["parallel=pp2", "checkpoint.interval=2"]}
FOUR_LAYERS = ["model.n_layers=4"]
FOUR_RANKS = {
    "tp2_fsdp2": ["parallel=tp2_fsdp"],
    "pp2_fsdp2": ["parallel=pp2_fsdp"],
    "pp4": ["parallel=pp2", "parallel.pp=4", *FOUR_LAYERS],  # first and last stage: a group of their own
}
REFERENCE_OF = {"pp4": "one_4l"}


def digest(param) -> str:
    """The bytes of the whole matrix (gathered over this stage's data-parallel ranks)."""
    whole = param.full_tensor() if isinstance(param, DTensor) else param
    return hashlib.sha256(whole.detach().contiguous().numpy().tobytes()).hexdigest()


def run_tied(scenarios: dict[str, list[str]], root: str) -> dict[str, dict]:
    """Each rank: whether its head is the embedding before and after training, how many tensors it holds, a digest
    of its embedding matrix at the start and the end; rank 0 also the curves."""
    from forge.parallel.dist import is_main_process

    out = {}
    for name, overrides in scenarios.items():
        trainer = Trainer(compose([*TINY, *TIED, *overrides]), Path(root) / name)
        parts = trainer.pipeline.parts if trainer.pipeline is not None else [trainer.model]
        heads = [part for part in parts if part.output is not None]
        embeddings = [part.tok_embeddings.weight for part in parts if part.tok_embeddings is not None]
        tied_before = all(head.output.weight is head.tok_embeddings.weight for head in heads)
        start = [digest(e) for e in embeddings]
        n_tensors = len(list(trainer.model.parameters()))
        trainer.fit()
        out[name] = {
            "tied": tied_before and all(head.output.weight is head.tok_embeddings.weight for head in heads),
            "has_head": bool(heads),
            "n_tensors": n_tensors,
            "start": start,
            "end": [digest(e) for e in embeddings],
        } | (curves(trainer.run_dir) if is_main_process() else {})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    scenarios = {"one": ["parallel=single"], "one_4l": ["parallel=single", *FOUR_LAYERS]}
    return launch(run_tied, 1, scenarios, str(tmp_path_factory.mktemp("one")))[0]


def assert_like_one_process(ranks: list[dict], want: dict) -> None:
    got = ranks[0]
    assert want["tied"] and all(rank["tied"] for rank in ranks)
    for key in ("loss", "grad_norm", "val_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key
    if got["has_head"]:  # not pipelined: one embedding matrix, not two
        assert got["n_tensors"] == want["n_tensors"]
        return
    # pipelined: the first stage (rank 0) and every last-stage rank hold equal matrices, at the start and the end
    last = [rank for rank in ranks if rank["has_head"]]
    assert last and all(len(rank["end"]) == 1 for rank in last)
    for rank in last:
        assert (rank["start"], rank["end"]) == (got["start"], got["end"])
    assert got["start"] == want["start"]  # the one-process initial matrix
    assert got["end"] != got["start"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    return launch(run_tied, 2, LAYOUTS, str(root)), root


def test_two_rank_layouts_keep_embeddings_tied(reference, two_ranks):
    runs, _ = two_ranks
    for name in LAYOUTS:
        assert_like_one_process([rank[name] for rank in runs], reference[REFERENCE_OF.get(name, "one")])


def test_a_pipelined_checkpoint_resumes_in_one_process(two_ranks, tmp_path):
    """The two stages' copies are saved under one name; one process resumes them and continues the curve."""
    runs, root = two_ranks
    checkpoint = root / "pp2" / "checkpoints" / "step-00000002"
    resumed = {"resumed": ["parallel=single", f"checkpoint.resume={checkpoint}"]}
    got = launch(run_tied, 1, resumed, str(tmp_path))[0]["resumed"]
    want = runs[0]["pp2"]
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key][2:], rel=1e-5), key


def test_four_rank_layouts_keep_embeddings_tied(reference, tmp_path):
    runs = launch(run_tied, 4, FOUR_RANKS, str(tmp_path))
    for name in FOUR_RANKS:
        assert_like_one_process([rank[name] for rank in runs], reference[REFERENCE_OF.get(name, "one")])
