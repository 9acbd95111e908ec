"""Every data/tensor-parallel layout trains like one process: same initial weights, data, losses, grad norms.

Each launch forks real gloo ranks running the real Trainer on several layouts in turn (one launch amortises
process start-up); the reference is the same Trainer in one process with parallel=single.
"""

import subprocess
import sys

import pytest

from tests.conftest import ROOT, forge_cmd
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY, curves, run_scenarios

# Every layout evaluates the same 8 validation samples: train.eval_batches (1) global batches of 8.
RTOL = 1e-4
COMPILE_RTOL = 1e-3  # inductor fuses and reorders fp32 arithmetic

pytestmark = pytest.mark.dist  # fp32; measured differences are ~1e-6 (summation order of the sharded reductions)

REFERENCE = {"single": ["parallel=single", "train.micro_batch_size=8"]}
TWO_RANKS = {
    "ddp": ["parallel=ddp", "train.micro_batch_size=4"],
    "fsdp": ["parallel=fsdp", "train.micro_batch_size=4"],
    "fsdp_accum": ["parallel=fsdp", "train.micro_batch_size=2"],
    "tp2": ["parallel=tp2", "train.micro_batch_size=8"],
    "tp2_accum": ["parallel=tp2", "train.micro_batch_size=4"],
    "fsdp_ac_full": ["parallel=fsdp", "train.micro_batch_size=4", "parallel.activation_checkpoint=full"],
    "fsdp_ac_selective": ["parallel=fsdp", "train.micro_batch_size=4", "parallel.activation_checkpoint=selective"],
}
FOUR_RANKS = {
    "hsdp": ["parallel=hsdp", "train.micro_batch_size=2"],
    "tp2_fsdp": ["parallel=tp2_fsdp", "train.micro_batch_size=4"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("single"))
    return launch(run_scenarios, 1, REFERENCE, root)[0]["single"]


@pytest.fixture(scope="module")
def two_rank_curves(tmp_path_factory):
    return launch(run_scenarios, 2, TWO_RANKS, str(tmp_path_factory.mktemp("two")))[0]


@pytest.fixture(scope="module")
def four_rank_curves(tmp_path_factory):
    return launch(run_scenarios, 4, FOUR_RANKS, str(tmp_path_factory.mktemp("four")))[0]


def assert_same_curves(got: dict, want: dict) -> None:
    assert len(got["loss"]) == len(want["loss"]) == 4
    for key in ("loss", "grad_norm", "val_loss"):
        assert got[key] == pytest.approx(want[key], rel=RTOL), key


def test_reference_learns(reference):
    assert reference["loss"][-1] < reference["loss"][0]
    assert reference["val_loss"][-1] < reference["val_loss"][0]


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_rank_layout_matches_one_process(layout, two_rank_curves, reference):
    assert_same_curves(two_rank_curves[layout], reference)


# str() of the DTensor placements of layers.0.attention.wq.weight: R = replicate, S(0) = shard rows,
# _S(0, 2) = FSDP's strided shard of rows that TP already split.
EXPECTED_WQ_PLACEMENTS = {
    "ddp": ["R", "S(0)"],  # the shard dimension has size 1: a full copy on every rank
    "fsdp": ["S(0)"],
    "fsdp_accum": ["S(0)"],
    "tp2": ["S(0)"],
    "tp2_accum": ["S(0)"],
    "fsdp_ac_full": ["S(0)"],
    "fsdp_ac_selective": ["S(0)"],
    "hsdp": ["R", "S(0)"],
    "tp2_fsdp": ["_S(0, 2)", "S(0)"],
}


def test_the_plan_was_applied(two_rank_curves, four_rank_curves, reference):
    runs = two_rank_curves | four_rank_curves
    assert reference["wq_placements"] == [] and reference["local_params"] == reference["params"]
    assert {name: run["wq_placements"] for name, run in runs.items()} == EXPECTED_WQ_PLACEMENTS
    assert runs["ddp"]["local_params"] == reference["params"]
    for name in ("fsdp", "tp2", "hsdp"):
        assert runs[name]["local_params"] < 0.6 * reference["params"], name
    assert runs["tp2_fsdp"]["local_params"] < 0.3 * reference["params"]
    assert runs["fsdp_ac_full"]["block_type"] == runs["fsdp_ac_selective"]["block_type"] == "FSDPCheckpointWrapper"


@pytest.mark.parametrize("layout", list(FOUR_RANKS))
def test_four_rank_layout_matches_one_process(layout, four_rank_curves, reference):
    assert_same_curves(four_rank_curves[layout], reference)


COMPILED = {  # name -> (parallel layout, compile scope, what the log says was compiled)
    "single": ("single", "blocks", "torch.compile of 2 blocks"),
    "fsdp": ("fsdp", "blocks", "torch.compile of 2 blocks"),
    "cp2": ("cp2", "blocks", "torch.compile of 2 blocks"),  # the keys' and values' gather inside the graph
    "pp2": ("pp2", "blocks", "torch.compile of 1 block"),  # each stage's block (rank 0's log)
    "single_whole_model": ("single", "model", "torch.compile of the whole forward (2 blocks) as one graph"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_runs_match_one_process(name, tmp_path, reference):
    """forge-train (one process) and torchrun (2 FSDP, context-parallel or pipeline ranks) with parallel.compile=true,
    by blocks and (one process) as one graph, in processes of their own: inductor's compile workers do not survive
    a fork, so the forked launch of the other tests cannot run it."""
    layout, scope, compiled = COMPILED[name]
    args = [*TINY, f"parallel={layout}", "parallel.compile=true", f"parallel.compile_scope={scope}"]
    args.append(f"hydra.run.dir={tmp_path}")
    ranks = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [sys.executable, *ranks, *(["-m", "forge.train"] if ranks else forge_cmd()[1:]), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "forge.log").read_text()
    assert compiled in log and "torch.compile of the loss's cross-entropy" in log
    run = curves(tmp_path)
    for key in ("loss", "grad_norm", "val_loss"):
        assert run[key] == pytest.approx(reference[key], rel=COMPILE_RTOL), key


Z_LOSS = ["loss=z_loss", "loss.z_loss_weight=1e-2"]


def split_logits(root: str) -> dict:
    """Under tp2: the head's logits as the loss sees them, and what the z-loss's logsumexp of them moves."""
    from pathlib import Path

    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    from forge.config import compose
    from forge.train.losses import logsumexp
    from forge.train.trainer import Trainer

    trainer = Trainer(compose([*TINY, "parallel=tp2", "train.micro_batch_size=8"]), Path(root))
    tokens = torch.arange(2 * 16).view(2, 16) % trainer.model.args.vocab_size
    logits = trainer.model(tokens)
    with CommDebugMode() as comm:
        lse = logsumexp(logits.float())
    whole = logits.full_tensor()
    return {
        "placements": [str(p) for p in logits.placements],
        "local_vocab": logits.to_local().shape[-1],
        "vocab": trainer.model.args.vocab_size,
        "collectives": sorted(str(op) for op in comm.get_comm_counts()),
        "lse_error": (lse - torch.logsumexp(whole.float(), dim=-1)).abs().max().item(),
    }


def test_tensor_parallel_logits_stay_split_over_the_vocabulary(tmp_path):
    """No rank holds (or gathers) the tokens x vocab logits: each has its vocab / tp columns, and the z-loss's
    logsumexp combines the shards' statistics with all-reduces of one number per token."""
    rank0 = launch(split_logits, 2, str(tmp_path))[0]
    assert rank0["placements"] == ["S(2)"] and rank0["local_vocab"] * 2 == rank0["vocab"]
    assert rank0["collectives"] == ["c10d_functional.all_reduce"]
    assert rank0["lse_error"] < 1e-5


def test_tp2_with_z_loss_matches_one_process(tmp_path):
    """Cross-entropy (torch's loss_parallel) and the z-loss over vocabulary-split logits train like one process."""
    one = launch(run_scenarios, 1, {"one": [*REFERENCE["single"], *Z_LOSS]}, str(tmp_path / "one"))[0]["one"]
    two = launch(run_scenarios, 2, {"tp2": [*TWO_RANKS["tp2"], *Z_LOSS]}, str(tmp_path / "two"))[0]["tp2"]
    assert_same_curves(two, one)
