"""The step's small all-reduces on 2 FSDP ranks: the non-finite flag, the preemption flag and the labelled-token
count travel in one int64 all-reduce, unless a router loss needs the count before the backward (then the count
is an all-reduce of its own, issued before the first forward and waited on after it). Both keep the token mean:
tests/train/test_token_mean.py and the parity tests compare their curves with one process."""

import pytest
import torch.distributed as dist

from forge.config import compose
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.tiny import TINY_MODEL

pytestmark = [pytest.mark.dist]

COMMON = [*TINY_MODEL, "parallel=fsdp", "train.dtype=fp32", "train.threads=1", "train.steps=4", "train.seq_len=32",
          "train.global_batch_size=4", "scheduler.warmup_steps=1", "metrics.console=quiet"]  # fmt: skip


def step_all_reduces(model: list[str], run_dir: str) -> dict:
    """Every dist.all_reduce of one training step (dtype, shape, async), and the summed token count."""
    trainer = Trainer(compose([*COMMON, *model]), run_dir)
    trainer.model.train()
    calls = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append((str(tensor.dtype), tuple(tensor.shape), kwargs.get("async_op", False)))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        trainer.train_step(trainer.state.step + 1)
    finally:
        dist.all_reduce = real
    tokens = trainer.step_body.count_folded and int(trainer.guard.pending[-1].world_tokens)
    return {"calls": calls, "world_tokens": tokens, "folded": trainer.step_body.count_folded}


def test_a_dense_step_folds_the_token_count_into_the_flags_all_reduce(tmp_path):
    ranks = launch(step_all_reduces, 2, [], str(tmp_path))
    for rank in ranks:
        assert rank["folded"]
        flags = [call for call in rank["calls"] if call[0] == "torch.int64"]
        assert flags == [("torch.int64", (3,), False)], rank["calls"]
        assert not [call for call in rank["calls"] if call[2]], "no separate count all-reduce"
        assert rank["world_tokens"] == 4 * 32  # the global batch's labelled tokens, each counted once


def test_a_router_loss_keeps_the_count_ahead_of_the_backward(tmp_path):
    ranks = launch(step_all_reduces, 2, ["model=moe_tiny"], str(tmp_path))
    for rank in ranks:
        assert not rank["folded"]
        assert ("torch.float32", (), True) in rank["calls"], rank["calls"]  # the count, overlapped with a forward
        assert ("torch.int64", (3,), False) in rank["calls"]
