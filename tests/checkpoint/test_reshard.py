"""A checkpoint of a 4-rank FSDP run resumes in other layouts with the saved state bit for bit and the same losses.

One `forge-train` run under torchrun (FSDP over 4 ranks, 6 steps, checkpoints at steps 3 and 6) is both the
checkpoint and the reference. Each other layout (HSDP 2 x 2, TP 2 x FSDP 2, one process, interleaved
1F1B over 2 pipeline ranks, context parallel 2 x FSDP 2) resumes from the step-3 checkpoint on forked gloo ranks
(tests/parallel/harness.py; the worker, tests/checkpoint/layout_worker.py, also runs under torchrun): its restored
model and optimizer, gathered to full tensors, must equal the checkpoint's contents read in this process with
`dcp_to_torch_save`; its losses of steps 4-6 must match the uninterrupted run's; and its own step-6 checkpoint must
hold the same keys as the reference's, with nearly the same values. And a context-parallel run's checkpoint
resumes in one process, bit for bit.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from forge.config import compose
from forge.train.trainer import Trainer
from tests.checkpoint.layout_worker import resume
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY
from tests.tiny import losses

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVED_AT = 6, 3
COMMON = [*TINY, "model.n_layers=4", "train.micro_batch_size=2", f"train.steps={STEPS}", "checkpoint.save_final=true"]
LOSS_RTOL = 1e-5
"""Another layout sums the same samples in another order (gradient accumulation, reduce-scatter over fewer ranks)."""
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6
"""Weights 3 AdamW steps later: Adam's normalisation amplifies that rounding noise of the gradients."""


def torchrun(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The 4-rank FSDP run: its losses, its step-3 checkpoint, and the contents of its step-3 and final checkpoints."""
    run = tmp_path_factory.mktemp("fsdp4")
    torchrun(
        4, "-m", "forge.train", "parallel=fsdp", *COMMON, f"checkpoint.milestones=[{SAVED_AT}]", f"hydra.run.dir={run}"
    )
    assert "FSDP over mesh {'dp_shard': 4}" in (run / "forge.log").read_text()
    checkpoint = run / f"checkpoints/step-{SAVED_AT:08d}"
    return {
        "losses": losses(run),
        "checkpoint": checkpoint,
        "state": consolidated(checkpoint),
        "final": consolidated(run / f"checkpoints/step-{STEPS:08d}"),
    }


def consolidated(checkpoint: Path) -> dict:
    """A checkpoint's contents as full tensors, read in this one process."""
    file = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, file)
    return torch.load(file, weights_only=True)


def merged_dumps(dump_dir: Path) -> dict:
    """The ranks' restored states as one; parameters held by several ranks must agree exactly."""
    merged: dict = {"model": {}, "optim": {}, "param_groups": {}, "layout": {}}
    for file in sorted(dump_dir.glob("rank*.pt")):
        dump = torch.load(file, weights_only=True)
        assert dump["step"] == SAVED_AT
        merged["layout"][int(file.stem.removeprefix("rank"))] = dump["layout"]
        parts = {
            "model": dump["model"],
            "optim": dump["optim"]["state"],
            "param_groups": {fqn: group["lr"] for group in dump["optim"]["param_groups"] for fqn in group["params"]},
        }
        for kind, values in parts.items():
            for key, value in values.items():
                if key in merged[kind]:
                    assert_identical(merged[kind][key], value, f"{file.name} {kind} {key}")
                merged[kind][key] = value
    return merged


def assert_identical(expected, actual, what: str) -> None:
    if isinstance(expected, dict):
        assert sorted(expected) == sorted(actual), what
        for key in expected:
            assert_identical(expected[key], actual[key], f"{what}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and expected.shape == actual.shape, what
        assert torch.equal(expected, actual), f"{what}: max diff {(expected - actual).abs().max().item()}"
    else:
        assert expected == actual, what


ALL_BLOCKS = [0, 1, 2, 3]
INTERLEAVED = ["parallel=pp2", "parallel.pp_schedule=interleaved_1f1b", "train.micro_batch_size=8"]
LAYOUTS = {
    # name: (overrides, per rank: the blocks it holds and str() of the placements of a wq weight, as tests/parallel)
    "hsdp2x2": (["parallel=hsdp"], [(ALL_BLOCKS, ["R", "S(0)"])] * 4),  # FSDP over 2, replicated twice
    "tp2_fsdp2": (["parallel=tp2_fsdp"], [(ALL_BLOCKS, ["_S(0, 2)", "S(0)"])] * 4),
    "single": (["parallel=single"], [(ALL_BLOCKS, [])]),
    "pp2_interleaved": (INTERLEAVED, [([0, 2], []), ([1, 3], [])]),  # two stages per rank: an nn.ModuleList
    "cp2_fsdp2": (["parallel=cp2_fsdp"], [(ALL_BLOCKS, ["S(0)"])] * 4),  # FSDP over dp_shard 2 x cp 2
    # tp 2 inside each of 2 stages: ranks 0-1 hold blocks 0-1 split over tp, ranks 2-3 blocks 2-3
    "tp2_pp2": (
        ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1"],
        [([0, 1], ["S(0)"])] * 2 + [([2, 3], ["S(0)"])] * 2,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp4_checkpoint_resumes_in_another_layout(saved, layout, tmp_path):
    overrides, expected_layout = LAYOUTS[layout]
    nproc = len(expected_layout)
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    args = [str(run), str(dumps), *COMMON, *overrides, f"checkpoint.resume={saved['checkpoint']}"]
    if nproc == 1:
        resume(*args[:2], args[2:])
    else:
        launch(resume, nproc, *args[:2], args[2:], timeout=420)  # forked gloo ranks: the saving run is torchrun
    assert sorted(p.name for p in dumps.iterdir()) == [f"rank{r}.pt" for r in range(nproc)]

    restored, state = merged_dumps(dumps), saved["state"]
    layouts = restored.pop("layout")
    assert [(layouts[r]["blocks"], layouts[r]["placements"]) for r in range(nproc)] == expected_layout
    assert_identical(state["model"], restored["model"], "model")
    assert_identical(state["optim"]["state"], restored["optim"], "optimizer state")
    assert all(s["step"].item() == SAVED_AT for s in restored["optim"].values())
    saved_lrs = {fqn: group["lr"] for group in state["optim"]["param_groups"] for fqn in group["params"]}
    assert saved_lrs == restored["param_groups"]

    resumed, whole = losses(run), saved["losses"]
    assert sorted(resumed) == list(range(SAVED_AT + 1, STEPS + 1))
    torch.testing.assert_close(
        [resumed[s] for s in sorted(resumed)], [whole[s] for s in sorted(resumed)], rtol=LOSS_RTOL, atol=0
    )

    # This layout's own final checkpoint: the whole model's names, and (nearly) the uninterrupted run's values.
    final, expected = consolidated(run / f"checkpoints/step-{STEPS:08d}"), saved["final"]
    assert sorted(final["model"]) == sorted(expected["model"])
    assert sorted(final["optim"]["state"]) == sorted(expected["optim"]["state"])
    torch.testing.assert_close(final["model"], expected["model"], rtol=PARAM_RTOL, atol=PARAM_ATOL)


def train(run_dir: str, overrides: list[str]) -> dict:
    trainer = Trainer(compose(overrides), Path(run_dir))
    trainer.fit()
    degrees = trainer.degrees
    return {
        "cp": degrees.cp,
        "pp": degrees.pp,
        "ep": degrees.ep,
        "splits_sequences": trainer.step_body.context is not None,
    }


def test_context_parallel_checkpoint_resumes_in_one_process(tmp_path):
    """cp 2 on 2 gloo ranks saves at step 3; one process restores it bit for bit and trains on with its losses."""
    cp_run, run, dumps = tmp_path / "cp2", tmp_path / "run", tmp_path / "dumps"
    ran = launch(train, 2, str(cp_run), [*COMMON, "parallel=cp2", f"checkpoint.milestones=[{SAVED_AT}]"], timeout=420)
    assert ran == [{"cp": 2, "pp": 1, "ep": 1, "splits_sequences": True}] * 2
    checkpoint = cp_run / f"checkpoints/step-{SAVED_AT:08d}"
    resume(str(run), str(dumps), [*COMMON, "parallel=single", f"checkpoint.resume={checkpoint}"])

    state, restored = consolidated(checkpoint), merged_dumps(dumps)
    assert_identical(state["model"], restored["model"], "model")
    assert_identical(state["optim"]["state"], restored["optim"], "optimizer state")
    resumed, whole = losses(run), losses(cp_run)
    assert sorted(resumed) == list(range(SAVED_AT + 1, STEPS + 1))
    torch.testing.assert_close(
        [resumed[s] for s in sorted(resumed)], [whole[s] for s in sorted(resumed)], rtol=LOSS_RTOL, atol=0
    )


def test_tp2_pp2_checkpoint_resumes_in_one_process_and_in_fsdp4(tmp_path):
    """tp 2 x pp 2 on 4 gloo ranks saves at step 3; one process and FSDP over 4 ranks each restore it bit for bit
    and train on with its losses (the other way, fsdp4 -> tp2 x pp2, is LAYOUTS' tp2_pp2)."""
    tp_pp = ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1"]
    saving = tmp_path / "tp2_pp2"
    launch(train, 4, str(saving), [*COMMON, *tp_pp, f"checkpoint.milestones=[{SAVED_AT}]"], timeout=420)
    checkpoint = saving / f"checkpoints/step-{SAVED_AT:08d}"
    state, whole = consolidated(checkpoint), losses(saving)
    for name, overrides, nproc in (("single", ["parallel=single"], 1), ("fsdp4", ["parallel=fsdp"], 4)):
        overrides = [*COMMON, *overrides, f"checkpoint.resume={checkpoint}"]
        assert_resumes_bitwise(tmp_path, name, nproc, overrides, state, whole, LOSS_RTOL)


def assert_resumes_bitwise(root: Path, name: str, nproc: int, overrides: list[str], state, whole, rtol: float):
    """`overrides` (a resume of the checkpoint whose contents are `state` and whose run logged `whole`) on `nproc`
    ranks restores it bit for bit and trains steps SAVED_AT + 1 .. STEPS with its losses."""
    run, dumps = root / name, root / f"{name}_dumps"
    if nproc == 1:
        resume(str(run), str(dumps), overrides)
    else:
        launch(resume, nproc, str(run), str(dumps), overrides, timeout=420)
    restored = merged_dumps(dumps)
    assert_identical(state["model"], restored["model"], f"{name}: model")
    assert_identical(state["optim"]["state"], restored["optim"], f"{name}: optimizer state")
    resumed = losses(run)
    assert sorted(resumed) == list(range(SAVED_AT + 1, STEPS + 1)), name
    torch.testing.assert_close(
        [resumed[s] for s in sorted(resumed)], [whole[s] for s in sorted(resumed)], rtol=rtol, atol=0
    )


def test_moe_pp2_ep2_checkpoint_resumes_in_one_process_and_in_fsdp2(tmp_path):
    """An MoE's pp 2 x ep 2 run on 4 gloo ranks (each stage's experts split over 2 ranks) saves at step 3; one process
    and FSDP over 2 ranks each restore it bit for bit and train on with its losses. Chunks of one sample there and
    micro-batches of one here, so every balancing loss and solve sees the same tokens."""
    moe = ["model=moe_tiny", "model.moe.num_experts=4", "model.moe.expert_ffn_dim=32"]
    saving = tmp_path / "pp2_ep2"
    pp_ep = ["parallel=pp2_fsdp", "parallel.ep=2", "parallel.microbatches=2", f"checkpoint.milestones=[{SAVED_AT}]"]
    ran = launch(train, 4, str(saving), [*moe, *COMMON, *pp_ep], timeout=420)
    assert ran == [{"cp": 1, "pp": 2, "ep": 2, "splits_sequences": False}] * 4
    checkpoint = saving / f"checkpoints/step-{SAVED_AT:08d}"
    state, whole = consolidated(checkpoint), losses(saving)
    one_sample = ["train.micro_batch_size=1", f"checkpoint.resume={checkpoint}"]
    for name, layout, nproc in (("single", "parallel=single", 1), ("fsdp2", "parallel=fsdp", 2)):
        assert_resumes_bitwise(tmp_path, name, nproc, [*moe, *COMMON, layout, *one_sample], state, whole, 1e-4)
