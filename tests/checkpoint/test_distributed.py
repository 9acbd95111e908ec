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
