"""Short training runs of the real Trainer, as run on each rank of a launch, and their logged curves."""

import json
import tempfile
from pathlib import Path

from forge.config import compose
from forge.parallel.plan import count_local_parameters
from forge.train.trainer import Trainer

# Tiny Llama on the embedded corpus, fp32 so that parity is tight; 4 steps, a loss and a grad norm per step.
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.ffn_dim=128",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.dtype=fp32",
    "train.threads=1",
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optimizer.lr=3e-3",
    "scheduler.warmup_steps=2",
    "metrics.console=quiet",
]


def curves(run_dir: Path) -> dict[str, list[float]]:
    """Per-step loss and grad norm and the evaluations, from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "loss": [r["loss"] for r in records if "loss" in r],
        "grad_norm": [r["grad_norm"] for r in records if "grad_norm" in r],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
    }


def run_scenarios(scenarios: dict[str, list[str]], root: str) -> dict[str, dict]:
    """Train each scenario in turn on this rank; rank 0 returns the curves (the others an empty dict)."""
    out = {}
    for name, overrides in scenarios.items():
        run_dir = Path(root) / name
        trainer = Trainer(compose([*TINY, *overrides]), run_dir)
        before = layout(trainer)  # before any forward: FSDP leaves the root unsharded after one
        trainer.fit()
        if _is_rank0():
            out[name] = curves(trainer.run_dir) | before
    return out


def layout(trainer: Trainer) -> dict:
    """What the plan did to the model, so a test can tell a parallel run from an accidental single one."""
    block = trainer.model.layers["0"]
    attention = getattr(block, "attention", None)  # wrappers forward attribute access
    linear = None
    if attention is not None:
        linear = attention.wq if hasattr(attention, "wq") else attention.wq_b  # latent: its up-projection
        wq = linear.weight
    else:  # another family's block: its first matrix
        wq = next(p for p in block.parameters() if p.ndim >= 2)
    return {
        "wq_placements": [str(p) for p in getattr(wq, "placements", ())],
        "wq_type": type(linear).__name__,
        "local_params": count_local_parameters(trainer.model),
        "params": trainer.n_params,
        "block_type": type(trainer.model.layers["0"]).__name__,
    }


def _is_rank0() -> bool:
    from forge.parallel.dist import is_main_process

    return is_main_process()


def temp_root() -> str:
    return tempfile.mkdtemp(prefix="forge-parallel-")
