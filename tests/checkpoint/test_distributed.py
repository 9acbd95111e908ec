"""Checkpoints with real gloo ranks: a 2-rank FSDP run stopped and resumed reproduces the uninterrupted one."""

import contextlib
from pathlib import Path

import pytest

from forge.config import compose
from forge.parallel.dist import is_main_process
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY, curves
from tests.tiny import Crash, CrashingTrainer

pytestmark = pytest.mark.dist


class CrashAfter6(CrashingTrainer):
    crash_after = 6


def exact_resume(root: str) -> dict:
    """Run 8 steps whole, and 8 steps cut at 6 and resumed from the step-4 checkpoint; rank 0 returns both curves."""
    common = [*TINY, "parallel=fsdp", "train.micro_batch_size=2", "train.steps=8"]
    Trainer(compose(common), Path(root) / "whole").fit()
    cut = [*common, "checkpoint.interval=4"]
    with contextlib.suppress(Crash):
        CrashAfter6(compose(cut), Path(root) / "cut").fit()
    resumed = Trainer(compose(cut), Path(root) / "cut")
    start = resumed.state.step
    resumed.fit()
    if not is_main_process():
        return {}
    return {"whole": curves(Path(root) / "whole")["loss"], "cut": curves(Path(root) / "cut")["loss"], "start": start}


def test_two_rank_fsdp_resume_is_bitwise_exact(tmp_path):
    result = launch(exact_resume, 2, str(tmp_path))[0]
    assert result["start"] == 4
    assert len(result["whole"]) == 8
    # the cut run logged steps 1..6, then the resumed run appended steps 5..8
    assert len(result["cut"]) == 10
    assert result["cut"][:6] == result["whole"][:6]
    assert result["cut"][6:] == result["whole"][4:]


def async_every_step(root: str) -> dict:
    """8 steps whole; 8 steps saving asynchronously every step (with a liveness barrier every step, the per-step
    collective that could interleave with DCP's), cut at 6 and resumed from the latest checkpoint."""
    import torch.distributed as dist

    common = [*TINY, "parallel=fsdp", "train.steps=8"]
    Trainer(compose(common), Path(root) / "whole").fit()
    cut = [*common, "checkpoint.interval=1", "checkpoint.async_mode=async", "checkpoint.keep_last_n=8",
           "resilience.liveness_every_steps=1"]  # fmt: skip
    crashing = CrashAfter6(compose(cut), Path(root) / "cut")
    group = crashing.checkpointer.async_group
    own_gloo_group = group is not None and group != dist.group.WORLD and dist.get_backend(group) == "gloo"
    with contextlib.suppress(Crash):
        crashing.fit()
    resumed = Trainer(compose(cut), Path(root) / "cut")
    start = resumed.state.step
    resumed.fit()
    if not is_main_process():
        return {}
    sealed = sorted(p.name for p in (Path(root) / "cut" / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    return {
        "whole": curves(Path(root) / "whole")["loss"],
        "cut": curves(Path(root) / "cut")["loss"],
        "start": start,
        "sealed": sealed,
        "own_gloo_group": own_gloo_group,
    }


def test_two_rank_async_saves_every_step_seal_and_resume_bitwise(tmp_path):
    result = launch(async_every_step, 2, str(tmp_path))[0]
    assert result["own_gloo_group"]  # not the default group, which is NCCL on GPUs
    assert result["start"] >= 5  # the crash came after step 6; at least step 5's write was sealed by then
    assert len(result["sealed"]) == 8, result["sealed"]  # steps 1..8, each sealed (the resumed run re-saved)
    assert result["cut"][: result["start"]] == result["whole"][: result["start"]]
    assert result["cut"][-(8 - result["start"]) :] == result["whole"][result["start"] :]
