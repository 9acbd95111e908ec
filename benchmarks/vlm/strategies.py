"""Loss curves of the four VLM strategies on the embedded easy-vqa pairs (and the joint decoder on video clips),
side by side from one command:

    python benchmarks/vlm/strategies.py [--steps 60] [--eval-every 20]

Prints, per run, the training loss every 10 steps and the validation loss at each evaluation.
"""

import argparse
import json
import tempfile
from pathlib import Path

from forge.config import compose
from forge.train.vlm_trainer import VLMTrainer

TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "train.seq_len=16",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.dtype=fp32",
    "train.log_every=10",
    "train.eval_batches=4",
    "scheduler.warmup_steps=5",
    "optimizer.lr=3e-3",
    "metrics.console=quiet",
]

RUNS = {
    "joint_decoder": ["vlm=joint_decoder", "data=vqa_embedded"],
    "cross_attention": ["vlm=cross_attention", "data=vqa_embedded"],
    "mot": ["vlm=mot", "data=vqa_embedded"],
    "moma": ["vlm=moma", "data=vqa_embedded"],
    "joint_decoder/video": [
        "vlm=joint_decoder",
        "data=video_embedded",
        "vlm.connector=avgpool",
        "vlm.connector_tokens=4",
        "vlm.time_embedding=true",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for name in args.only:
            overrides = [*RUNS[name], *TINY, f"train.steps={args.steps}", f"train.eval_every={args.eval_every}"]
            run_dir = Path(root) / name.replace("/", "-")
            summary = VLMTrainer(compose(overrides), run_dir).fit()
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            train = " ".join(f"{r['step']}:{r['loss']:.2f}" for r in records if "loss" in r)
            val = " ".join(f"{r['step']}:{r['val_loss']:.2f}" for r in records if "val_loss" in r)
            print(f"{name:22s} params {summary['params'] / 1e6:.2f}M | train {train} | val {val}", flush=True)


if __name__ == "__main__":
    main()
