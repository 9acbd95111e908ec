"""The single-process loop on the embedded corpus."""

import json

import pytest
import torch

from forge.config import compose
from forge.train.trainer import Trainer
from tests.tiny import TINY_MODEL

TINY = [
    *TINY_MODEL,
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.dtype=fp32",
    "train.log_every=5",
    "train.eval_batches=4",
    "scheduler.warmup_steps=5",
]


def run(tmp_path, *overrides: str):
    cfg = compose([*TINY, *overrides])
    summary = Trainer(cfg, tmp_path).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def test_loss_falls_and_metrics_are_written(tmp_path):
    summary, records = run(tmp_path, "train.steps=60", "train.eval_every=30", "optimizer.lr=3e-3")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == list(range(5, 61, 5))
    assert [r["step"] for r in evals] == [0, 30, 60]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "loss_smooth", "tokens_seen"):
        assert key in train[0]
    assert evals[0]["val_loss"] == pytest.approx(torch.log(torch.tensor(8192.0)).item(), abs=0.6)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 2.0
    assert train[-1]["loss"] < train[0]["loss"]
    assert summary["final_val_loss"] == evals[-1]["val_loss"]
    assert summary["tokens"] == 60 * 8 * 64


def test_fixed_seed_is_bitwise_deterministic(tmp_path):
    _, a = run(tmp_path / "a", "train.steps=10")
    _, b = run(tmp_path / "b", "train.steps=10")
    _, c = run(tmp_path / "c", "train.steps=10", "train.seed=7")
    losses = lambda recs: [r.get("loss", r.get("val_loss")) for r in recs]  # noqa: E731
    assert losses(a) == losses(b)
    assert losses(a) != losses(c)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    _, whole = run(tmp_path / "a", "train.steps=5", "train.eval_every=0")
    _, accum = run(tmp_path / "b", "train.steps=5", "train.eval_every=0", "train.micro_batch_size=2")
    w = [r["loss"] for r in whole if "loss" in r]
    a = [r["loss"] for r in accum if "loss" in r]
    assert a == pytest.approx(w, rel=1e-4)


def test_weight_decay_only_on_matrices(tmp_path):
    trainer = Trainer(compose([*TINY, "train.steps=5"]), tmp_path)
    decay, no_decay = trainer.optimizer.param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(
        names[id(p)].endswith(
            ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight", "output.weight")
        )
        for p in decay["params"]
    )
    assert {names[id(p)] for p in no_decay["params"]} >= {"tok_embeddings.weight", "norm.weight"}
