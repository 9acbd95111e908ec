"""The optimizers and the chunked loss under FSDP (and TP) train like one process.

Muon gathers each matrix's update, orthogonalises it whole on every rank and keeps the rank's shard; Lion and
schedule-free AdamW are elementwise on the shards (schedule-free's train/eval switches too); chunked cross-entropy
applies the head after the root module's forward, whose parameters FSDP keeps gathered until the backward.

Real gloo ranks (fork harness) running the real Trainer; each reference is one process with parallel=single.
"""

import pytest

from tests.parallel.harness import launch
from tests.parallel.scenarios import run_scenarios

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # 8 short Trainer runs, ~30 s on 2 cores

OPTIMIZERS = {
    "muon": ["optimizer=muon", "optimizer.lr=0.02"],  # its own default (scenarios.TINY sets 3e-3)
    "lion": ["optimizer=lion", "optimizer.lr=1e-3"],
    "schedule_free": ["optimizer=schedule_free_adamw", "scheduler=constant"],
}
REFERENCE = {f"single_{name}": ["parallel=single", "train.micro_batch_size=8", *o] for name, o in OPTIMIZERS.items()}
FSDP = ["parallel=fsdp", "train.micro_batch_size=4"]
TWO_RANKS = {  # scenario -> (overrides, reference)
    "fsdp_muon": ([*FSDP, *OPTIMIZERS["muon"]], "single_muon"),
    "tp2_muon": (["parallel=tp2", "train.micro_batch_size=8", *OPTIMIZERS["muon"]], "single_muon"),
    "fsdp_muon_chunked_ce": (
        [*FSDP, *OPTIMIZERS["muon"], "loss=chunked_cross_entropy", "loss.chunk_size=48"],
        "single_muon",
    ),
    "fsdp_lion": ([*FSDP, *OPTIMIZERS["lion"]], "single_lion"),
    "fsdp_schedule_free": ([*FSDP, *OPTIMIZERS["schedule_free"]], "single_schedule_free"),
}


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    reference = launch(run_scenarios, 1, REFERENCE, str(tmp_path_factory.mktemp("one")))[0]
    two = {name: overrides for name, (overrides, _) in TWO_RANKS.items()}
    return reference | launch(run_scenarios, 2, two, str(tmp_path_factory.mktemp("two")))[0]


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_sharded_run_matches_one_process(curves, layout):
    got, want = curves[layout], curves[TWO_RANKS[layout][1]]
    assert got["wq_placements"] == ["S(0)"]  # really sharded
    assert len(got["loss"]) == len(want["loss"]) == 4
    assert want["loss"][-1] < want["loss"][0]
    for key in ("loss", "grad_norm", "val_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key
