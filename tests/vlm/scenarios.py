"""Short VLM training runs of the real trainer (also run on each rank of a forked launch)."""

from pathlib import Path

from forge.config import compose
from forge.train.vlm_trainer import VLMTrainer
from tests.tiny import TINY_MODEL, losses

TINY = [
    *TINY_MODEL,
    "train.seq_len=12",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.dtype=fp32",
    "train.threads=1",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=2",
    "scheduler.warmup_steps=2",
    "optimizer.lr=3e-3",
    "metrics.console=quiet",
]


VQA = ["data=vqa_embedded", "data.train_records=400", "data.val_records=16"]


def train(run_dir: str, *overrides: str) -> dict:
    """Train on this rank; returns the summary plus the per-step losses (rank 0's log)."""
    from torch.distributed.tensor import DTensor

    data = [] if any(o.startswith("data=") for o in overrides) else VQA
    trainer = VLMTrainer(compose([*data, *TINY, *overrides]), Path(run_dir))
    sharded = {
        "decoder": isinstance(trainer.model.decoder.layers["0"].attention.wq.weight, DTensor),
        "encoder": any(isinstance(p, DTensor) for p in trainer.model.encoder.parameters()),
    }
    summary = trainer.fit() | {"sharded": sharded}
    path = Path(run_dir) / "metrics.jsonl"
    return summary | {"losses": losses(run_dir) if path.is_file() else {}}
