"""An MoE against a dense model of equal active parameters on the embedded corpus, and how well each balancing
method spreads the load.

    .venv/bin/python benchmarks/moe/moe_vs_dense.py [--steps 150 --dim 128 --experts 8 --top-k 2 --expert-ffn 128]

Runs, with the same data, seed and schedule (fp32, one process):
  dense        SwiGLU of hidden top_k * expert_ffn (the MoE's active expert width)
  softmax_aux  softmax top-k router, Switch load-balancing loss (aux_loss_coef 0.01)
  sigmoid_bias sigmoid top-k router, aux-loss-free bias balancing (aux_loss_coef 0)
  sigmoid_none sigmoid top-k router, no balancing at all (the baseline the balancing should beat)
and prints each run's train-loss curve, validation loss, and the max/min expert load (multiples of the even share,
worst layer) over the last logged steps.
"""

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from forge.config import compose
from forge.train.trainer import Trainer


def run(overrides: list[str]) -> tuple[dict, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        summary = Trainer(compose(overrides), Path(tmp)).fit()
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in records if "loss" in r]


def load_extremes(logs: list[dict], last: int = 5) -> tuple[float, float]:
    """Worst layer's max and min load, averaged over the last `last` log records."""
    tail = logs[-last:]
    highs = [max(v for k, v in r.items() if k.endswith("/load_max")) for r in tail]
    lows = [min(v for k, v in r.items() if k.endswith("/load_min")) for r in tail]
    return sum(highs) / len(highs), sum(lows) / len(lows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=128)
    parser.add_argument("--bias-rate", type=float, default=0.01)
    opts = parser.parse_args()
    logging.getLogger("forge").setLevel(logging.WARNING)
    common = [
        f"model.dim={opts.dim}",
        f"model.n_layers={opts.layers}",
        "model.n_heads=4",
        "train.seq_len=128",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.dtype=fp32",
        f"train.steps={opts.steps}",
        "train.log_every=10",
        "train.eval_every=0",
        "train.eval_batches=4",
        "scheduler.warmup_steps=10",
        "optimizer.lr=3e-3",
        "metrics.console=quiet",
    ]
    moe = [
        "model=moe",
        f"model.moe.num_experts={opts.experts}",
        f"model.moe.top_k={opts.top_k}",
        f"model.moe.expert_ffn_dim={opts.expert_ffn}",
    ]
    runs = {
        "dense": [f"model.ffn_dim={opts.top_k * opts.expert_ffn}"],
        "softmax_aux": [*moe, "model.moe.router=softmax_topk", "model.moe.aux_loss_coef=0.01"],
        "sigmoid_bias": [
            *moe,
            "model.moe.router=sigmoid_topk",
            "model.moe.aux_loss_coef=0",
            f"model.moe.bias_update_rate={opts.bias_rate}",
        ],
        "sigmoid_none": [
            *moe,
            "model.moe.router=sigmoid_topk",
            "model.moe.aux_loss_coef=0",
            "model.moe.bias_update_rate=0",
        ],
    }
    results = {}
    for name, extra in runs.items():
        start = time.perf_counter()
        summary, logs = run([*common, *extra])
        wall = time.perf_counter() - start
        results[name] = (summary, logs, wall)
        curve = " ".join(f"{r['loss']:.2f}" for r in logs)
        print(f"{name:13s} params {summary['params'] / 1e6:.2f}M  {wall:5.1f}s  train loss @10-step intervals: {curve}")
    print()
    print(f"{'run':13s} {'final train':>11s} {'val':>7s} {'load max':>9s} {'load min':>9s}")
    for name, (summary, logs, _) in results.items():
        loads = load_extremes(logs) if name != "dense" else (float("nan"), float("nan"))
        print(f"{name:13s} {logs[-1]['loss']:11.3f} {summary['final_val_loss']:7.3f} {loads[0]:9.2f} {loads[1]:9.2f}")


if __name__ == "__main__":
    main()
