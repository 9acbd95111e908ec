"""A training step between log steps makes the host wait for nothing of its own: the non-finite check, the
preemption agreement and the token count travel in one all-reduce whose result the host reads during the next
step (when it waits for the previous step only), and a non-finite step's update is dropped on the device
(fused AdamW's `found_inf`). On a GPU a host read of the step's own tensors would stall the queue; here a spy on
every Python-level host read of a tensor finds each one and the step it belongs to."""

import pytest
import torch

from forge.config import compose
from forge.resilience.nonfinite import StepFlags
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.tiny import TINY_MODEL

COMMON = [*TINY_MODEL, "train.dtype=fp32", "train.threads=1", "train.seq_len=32", "train.global_batch_size=4",
          "scheduler.warmup_steps=1", "metrics.console=quiet"]  # fmt: skip
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


def host_reads_per_step(overrides: list[str], run_dir: str) -> dict:
    """Train 8 steps (log every 4) with every host read of a tensor recorded against the step in progress; the
    reads of a step's flags are recorded as (step in progress, step whose flags)."""
    trainer = Trainer(
        compose([*COMMON, "train.steps=8", "train.log_every=4", "train.eval_every=0", *overrides]), run_dir
    )
    current = {"step": 0, "inside_flags": False}
    reads: dict[int, list[str]] = {}
    flag_reads: list[tuple[int, int]] = []
    started = trainer.guard.step_started

    def step_started(step=None):
        current["step"] = step
        return started(step)

    trainer.guard.step_started = step_started
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def spy(name):
        def read(self, *args, **kwargs):
            if not current["inside_flags"]:
                reads.setdefault(current["step"], []).append(name)
            return originals[name](self, *args, **kwargs)

        return read

    real_read = StepFlags.read

    def read_flags(self):
        flag_reads.append((current["step"], self.step))
        current["inside_flags"] = True
        try:
            return real_read(self)
        finally:
            current["inside_flags"] = False

    StepFlags.read = read_flags
    for name in HOST_READS:
        setattr(torch.Tensor, name, spy(name))
    try:
        trainer.fit()
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        StepFlags.read = real_read
    return {"reads": reads, "flag_reads": flag_reads, "masked": trainer.masked_updates}


@pytest.mark.parametrize("ranks", [1, 2])
def test_steps_between_log_steps_read_nothing_of_their_own(tmp_path, ranks):
    layout = [] if ranks == 1 else ["parallel=fsdp"]
    for result in launch(host_reads_per_step, ranks, layout, str(tmp_path)):
        assert result["masked"]  # the default optimizer is fused AdamW
        quiet = [1, 2, 3, 5, 6, 7]  # not log, evaluation or checkpoint steps
        for step in quiet:
            assert not result["reads"].get(step), (step, result["reads"])
        assert result["reads"].get(4), "the spy sees the log step's reads"
        for in_progress, flags_of in result["flag_reads"]:
            if in_progress in quiet:  # only the last step's, whose work is done
                assert flags_of == in_progress - 1, result["flag_reads"]
        read = sorted(flags_of for _, flags_of in result["flag_reads"])
        assert read == list(range(1, 9)), result["flag_reads"]  # every step's check is applied, once
        # log steps read their own flags at once, so a log line never shows a step the policy has not judged
        assert (4, 4) in result["flag_reads"] and (8, 8) in result["flag_reads"]


def weights_and_moments(trainer: Trainer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in trainer.model.parameters()]
    for state in trainer.optimizer.state.values():
        tensors += [value.detach().clone() for value in state.values()]
    return tensors


@pytest.mark.parametrize("fused", [True, False])
def test_a_skipped_step_leaves_weights_and_moments_as_they_were(tmp_path, fused):
    """Under nonfinite_policy=skip a poisoned step changes nothing: with fused AdamW the device drops the update
    before the host has read the check; with an unfused optimizer the host reads it first."""
    cfg = compose([*COMMON, "train.steps=3", "resilience.inject_nan_at_step=2", "resilience.nonfinite_policy=skip",
                   f"optimizer.fused={str(fused).lower()}"])  # fmt: skip
    trainer = Trainer(cfg, tmp_path)
    trainer.model.train()
    assert trainer.masked_updates == fused
    trainer.train_step(1)
    trainer.state.step = 1
    before = weights_and_moments(trainer)
    trainer.train_step(2)  # the poisoned step
    trainer.state.step = 2
    assert trainer.guard.nonfinite.skipped == (0 if fused else 1)  # fused: not read yet
    trainer.guard.settle()
    assert trainer.guard.nonfinite.skipped == 1
    after = weights_and_moments(trainer)
    assert len(after) == len(before)
    for old, new in zip(before, after):
        assert torch.equal(old, new)
    trainer.train_step(3)  # and the next step trains again
    trainer.guard.settle()
    assert trainer.guard.nonfinite.skipped == 1
    assert not torch.equal(before[0], weights_and_moments(trainer)[0])


def test_a_rollback_read_while_passing_over_a_bad_step_stays_in_the_loop(tmp_path):
    """A fault that does not repeat on replay: NaN at step 6, rolled back; on the replay NaN at step 5, whose flags
    are still unread when step 6 (a bad step) is passed over. That read must roll back again, inside the loop."""
    cfg = compose([*COMMON, "train.steps=6", "train.log_every=10", "train.eval_every=0", "checkpoint.interval=2",
                   "resilience.nonfinite_policy=rollback"])  # fmt: skip
    trainer = Trainer(cfg, tmp_path)
    poisoned = iter([6, 5])
    at = {"step": next(poisoned)}

    def loss_for(step, loss):
        if step == at["step"]:
            at["step"] = next(poisoned, None)
            return lambda *args, **kwargs: loss(*args, **kwargs) * float("nan")
        return loss

    trainer.guard.loss_for = loss_for
    summary = trainer.fit()
    assert trainer.guard.nonfinite.rollbacks == 2
    assert trainer.guard.bad_steps == {5, 6}
    assert summary["steps"] == 6
