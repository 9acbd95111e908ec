"""The trainer on prepared shards: memmap with document masking, and a phased mixture (per-source tokens, lr scale)."""

import json

from forge.config import compose
from forge.data.prepare import prepare
from forge.train.trainer import Trainer
from tests.data.conftest import prepare_config
from tests.train.test_loop import TINY


def train(run_dir, *overrides: str) -> tuple[dict, list[dict]]:
    summary = Trainer(compose([*TINY, "model.vocab_size=50304", *overrides]), run_dir).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def test_memmap_with_document_masking_trains(tmp_path, inputs):
    out = tmp_path / "bpe"
    prepare(prepare_config(inputs=[str(inputs / "*")], out_dir=str(out), tokenizer="bpe", vocab_size=512))
    overrides = ["data=memmap", f"data.path={out}", "data.vocab_size=512", "data.val_fraction=0.1"]
    summary, _ = train(
        tmp_path / "run",
        *overrides,
        "model.vocab_size=512",
        "data.document_masking=true",
        "train.steps=10",
        "optimizer.lr=3e-3",
    )
    assert summary["final_val_loss"] < summary["first_val_loss"]


def test_mixture_phases_log_tokens_per_source_and_scale_lr(tmp_path, inputs):
    prepare(
        prepare_config(
            inputs=[str(inputs / "a.jsonl")], out_dir=str(tmp_path / "plays"), tokenizer="bpe", vocab_size=512
        )
    )
    tokenizer = tmp_path / "plays" / "tokenizer.json"
    prepare(prepare_config(inputs=[str(inputs / "b.parquet")], out_dir=str(tmp_path / "more"), tokenizer=tokenizer))
    overrides = [
        "data=mixture",
        "data.vocab_size=512",
        "model.vocab_size=512",
        f"data.sources.web.path={tmp_path / 'plays'}",
        f"data.sources.books.path={tmp_path / 'more'}",
        "data.phases.0.start_step=5",
        "data.phases.0.weights={web: 0.0, books: 1.0}",
        "data.phases.0.lr_scale=0.5",
        "scheduler=constant",
        "scheduler.warmup_steps=0",
        "train.steps=10",
    ]
    _, records = train(tmp_path / "run", *overrides)
    logged = [r for r in records if "loss" in r]
    first, last = logged[0], logged[-1]
    assert first["step"] == 5 and last["step"] == 10
    assert first["tokens_web"] + first["tokens_books"] == first["tokens_seen"]
    assert last["tokens_web"] == first["tokens_web"]  # phase 1 draws only books
    assert last["lr"] == 0.5 * first["lr"]
