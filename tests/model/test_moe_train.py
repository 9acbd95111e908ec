"""`forge-train model=moe` end to end on the embedded corpus: loss falls, MoE metrics are logged."""

import json

import pytest

from forge.config import compose
from forge.train.trainer import Trainer

TINY_MOE = [
    "model=moe",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.expert_ffn_dim=64",
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.dtype=fp32",
    "train.log_every=5",
    "train.eval_every=0",
    "train.eval_batches=2",
    "scheduler.warmup_steps=5",
    "optimizer.lr=3e-3",
]


def train(tmp_path, *overrides: str) -> tuple[dict, list[dict]]:
    summary = Trainer(compose([*TINY_MOE, *overrides]), tmp_path).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in records if "loss" in r]


@pytest.mark.parametrize(
    "router",
    [
        # Capacity drops need an expert above its share, which balanced selection does not leave.
        ["model.moe.router=softmax_topk", "model.moe.capacity_factor=1.25", "model.moe.balanced_selection=false"],
        [
            "model.moe.router=sigmoid_topk",
            "model.moe.num_shared_experts=1",
            "model.moe.bias_update_rate=0.01",
            "model.moe.balanced_selection=false",  # DeepSeek-V3's sign updates
        ],
    ],
    ids=["softmax-capacity", "sigmoid-shared-sign"],
)
def test_moe_trains_and_logs_router_metrics(tmp_path, router):
    summary, logs = train(tmp_path, "train.steps=30", *router)
    assert summary["final_val_loss"] < summary["first_val_loss"] - 1.0
    assert logs[-1]["loss"] < logs[0]["loss"] - 1.0
    last = logs[-1]
    for key in ("moe/aux_loss", "moe/z_loss", "moe/0/load_max", "moe/1/load_min", "moe/1/dropped"):
        assert key in last
    assert last["moe/0/load_max"] >= 1.0 >= last["moe/0/load_min"]
    assert 0.9 < last["moe/aux_loss"] < 4.0
    if "model.moe.capacity_factor=1.25" in router:
        assert any(r["moe/0/dropped"] > 0 for r in logs)
    else:
        assert all(r["moe/0/dropped"] == 0 for r in logs)
