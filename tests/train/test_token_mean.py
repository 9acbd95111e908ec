"""The loss is the mean over the global batch's labelled tokens: micro-batch size, accumulation and dp size do not
change it, also when micro-batches hold different numbers of labelled tokens (document masking, VLM prompts).

A mean of per-micro-batch means (what the trainer used to compute) weighs a token of a micro-batch with few labels
more than one of a full micro-batch; with short documents that moves the loss and its gradients by ~1e-3, far above
the rel 1e-5 here, which only fp32 summation order may use up.
"""

import json
from pathlib import Path

import pytest

from forge.config import compose
from forge.data.embedded import read_scenes
from forge.train.trainer import Trainer
from forge.train.vlm_trainer import VLMTrainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import curves
from tests.tiny import TINY_MODEL

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REL = 1e-5
COMMON = [
    *TINY_MODEL, "train.global_batch_size=8", "train.dtype=fp32", "train.threads=1", "train.steps=3",
    "train.log_every=1", "train.eval_every=0", "train.eval_batches=2", "scheduler.warmup_steps=1",
    "optimizer.lr=3e-3", "metrics.console=quiet",
]  # fmt: skip
LAYOUTS = {"mb8": ["train.micro_batch_size=8"], "mb1x8": ["train.micro_batch_size=1"]}
"""One process: the global batch of 8 in one micro-batch, or in 8 micro-batches of 1."""


def run(kind: str, layouts: dict[str, list[str]], root: str, data: list[str]) -> dict:
    from forge.parallel.dist import is_main_process

    trainer_cls = VLMTrainer if kind == "vlm" else Trainer
    out = {}
    for name, overrides in layouts.items():
        trainer = trainer_cls(compose([*data, *COMMON, *overrides]), Path(root) / name)
        trainer.fit()
        out[name] = curves(trainer.run_dir)
    return out if is_main_process() else {}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> Path:
    """Lines of the plays, one document each (~10 tokens): a 32-token sample holds several EOS, each unlabelled."""
    path = tmp_path_factory.mktemp("docs") / "lines.jsonl"
    lines = [line for scene in read_scenes()[:40] for line in scene.splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


def text_data(path: Path) -> list[str]:
    return [
        "data=hf", f"data.dataset={path}", "data.vocab_size=50257", "model.vocab_size=50304", "data.shuffle=false",
        "data.document_masking=true", "data.val_documents=64", "train.seq_len=32",
    ]  # fmt: skip


VLM_DATA = ["vlm=joint_decoder", "data=vqa_embedded", "data.train_records=400", "data.val_records=16",
            "train.seq_len=12"]  # fmt: skip


def assert_equal_curves(runs: dict[str, dict]) -> None:
    reference = runs.pop("mb8")
    for name, got in runs.items():
        for key in ("loss", "grad_norm", "val_loss"):
            assert got[key] == pytest.approx(reference[key], rel=REL), (name, key, got[key], reference[key])


@pytest.mark.parametrize("kind", ["text", "vlm"])
def test_micro_batch_accumulation_and_dp_size_give_the_same_token_mean(kind, short_documents, tmp_path):
    data = text_data(short_documents) if kind == "text" else VLM_DATA
    one = launch(run, 1, kind, LAYOUTS, str(tmp_path / "one"), data)[0]
    two = launch(run, 2, kind, {"dp2": ["parallel=fsdp"]}, str(tmp_path / "two"), data)[0]
    assert one["mb8"]["loss"][-1] < one["mb8"]["loss"][0]
    assert_equal_curves(one | two)
