"""Tied input and output embeddings stay one parameter under TP, TP x FSDP and FSDP, and train like one process."""

from pathlib import Path

import pytest

from forge.config import compose
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY, curves

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TIED = ["model.tie_embeddings=true"]
LAYOUTS = {"tp2": ["parallel=tp2"], "fsdp2": ["parallel=fsdp"]}
FOUR_RANKS = {"tp2_fsdp2": ["parallel=tp2_fsdp"]}


def run_tied(scenarios: dict[str, list[str]], root: str) -> dict[str, dict]:
    from forge.parallel.dist import is_main_process

    out = {}
    for name, overrides in scenarios.items():
        trainer = Trainer(compose([*TINY, *TIED, *overrides]), Path(root) / name)
        model = trainer.model
        tied_before = model.output.weight is model.tok_embeddings.weight
        n_tensors = len(list(model.parameters()))
        trainer.fit()
        out[name] = curves(trainer.run_dir) | {
            "tied": tied_before and model.output.weight is model.tok_embeddings.weight,
            "n_tensors": n_tensors,
        }
    return out if is_main_process() else {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(run_tied, 1, {"one": ["parallel=single"]}, str(tmp_path_factory.mktemp("one")))[0]["one"]


def assert_like_one_process(got: dict, want: dict) -> None:
    assert want["tied"] and got["tied"]
    assert got["n_tensors"] == want["n_tensors"]  # one embedding matrix, not two
    for key in ("loss", "grad_norm", "val_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key


def test_two_rank_layouts_keep_embeddings_tied(reference, tmp_path):
    runs = launch(run_tied, 2, LAYOUTS, str(tmp_path))[0]
    for name in LAYOUTS:
        assert_like_one_process(runs[name], reference)


def test_tp2_fsdp2_keeps_embeddings_tied(reference, tmp_path):
    runs = launch(run_tied, 4, FOUR_RANKS, str(tmp_path))[0]
    assert_like_one_process(runs["tp2_fsdp2"], reference)
