"""The golden runs: each a `forge-train` command a user could type, and the loss curve it is expected to draw.

Shared by tests/golden/test_golden.py (runs each case and compares) and tests/golden/regenerate.py (records the
curves and the tolerance in curves.json).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import forge_cmd

GOLDEN = Path(__file__).with_name("curves.json")

COMMON = [
    "train.steps=10",
    "scheduler.warmup_steps=5",
    "train.dtype=fp32",
    "train.threads=1",
    "train.log_every=1",
    "train.eval_every=0",
    "metrics.console=quiet",
    "metrics.measure_peak=false",
]
"""fp32 (bf16 would follow the CPU: auto picks it only where the CPU has native bf16), one thread per process,
every step logged, one evaluation at the end. A 5-step warmup and a learning rate below the default keep the 10
steps away from the loss spikes of a fast warmup, where a rounding difference of 1e-7 grows to a loss difference
of 1 within a few steps (measured: the MoE case at lr 3e-4 with a 2-step warmup) and no tolerance separates
another CPU from a real change."""

CASES: dict[str, dict] = {
    "default": {"ranks": 1, "overrides": ["optimizer.lr=1e-4"]},
    "moe": {"ranks": 1, "overrides": ["model=moe_tiny", "optimizer.lr=1e-4"]},
    "vlm_joint_decoder": {
        "ranks": 1,
        "overrides": [
            "vlm=joint_decoder",
            "data=vqa_embedded",
            "data.train_records=400",
            "data.val_records=16",
            "train.seq_len=12",
            "model.dim=64",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.ffn_dim=128",
            "optimizer.lr=1e-3",
        ],
    },
}
"""The default model, the default MoE and a VLM strategy: the commands as a user types them, with only the run
length and the learning rate set. The default config on 2 and 4 ranks is held to the one-process curve by
tests/parallel/test_any_world.py, which the "default" curve here pins."""


def command(name: str, extra: list[str] = ()) -> list[str]:
    case = CASES[name]
    launcher = forge_cmd()
    if case["ranks"] > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={case['ranks']}",
            "-m",
            "forge.train",
        ]
    return [*launcher, *case["overrides"], *COMMON, *extra]


def run_case(name: str, extra: list[str] = (), env: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Run one case in a fresh run directory; returns {"loss": per step 1..10, "val_loss": [final]}."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = command(name, [*extra, f"hydra.run.dir={run_dir}"])
        done = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    return {
        "loss": [losses[step] for step in sorted(losses)],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
    }


def max_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    """Largest absolute difference between two runs' curves (train and validation loss)."""
    if [len(v) for v in a.values()] != [len(v) for v in b.values()]:
        return float("inf")
    return max(abs(x - y) for key in a for x, y in zip(a[key], b[key], strict=True))
