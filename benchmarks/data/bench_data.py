"""Data pipeline throughput: forge-prepare-data vs a plain `datasets.map(batched=True)`, and the loaders.

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python benchmarks/data/bench_data.py

Input: the embedded Shakespeare corpus (scenes as jsonl), GPT-2's BPE. The default training run consumes about
2,000 tokens/s on a 2-core CPU; the loader rows say how far above that the data side is.
"""

import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TRAINING_TOKENS_PER_S = 2_000


def timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def bench_prepare(folder: Path) -> tuple[list[tuple[str, float, str]], Path]:
    from forge.config import compose
    from forge.data.embedded import read_scenes
    from forge.data.prepare import prepare

    scenes = read_scenes()
    source = folder / "scenes.jsonl"
    source.write_text("".join(json.dumps({"text": s}) + "\n" for s in scenes))
    cfg = compose([f"inputs=[{source}]", f"out_dir={folder / 'out'}", "progress=false"], config_name="prepare")
    meta, seconds = timed(lambda: prepare(cfg)[0])
    rows = [("forge-prepare-data (encode_batch, shards)", meta["tokens"] / seconds, f"{meta['tokens']:,} tokens")]

    import datasets
    from transformers import PreTrainedTokenizerFast

    from forge.data.tokenizer import gpt2_tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer(), eos_token="<|endoftext|>")
    datasets.disable_progress_bars()

    def plain_map():
        ds = datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(folder / "hf"))
        mapped = ds.map(lambda b: {"ids": hf(b["text"])["input_ids"]}, batched=True, remove_columns=["text"])
        return sum(len(ids) + 1 for ids in mapped["ids"])

    tokens, seconds = timed(plain_map)
    rows.append(("datasets.map(batched=True), same tokenizer", tokens / seconds, f"{tokens:,} tokens"))
    return rows, folder / "out"


def bench_loaders(prepared: Path) -> list[tuple[str, float, str]]:
    from forge.config.schema import MemmapDataConfig, MixtureDataConfig, options
    from forge.data.loader import BatchLoader, TokenWindows, batch_to_device
    from forge.data.memmap import MemmapCorpus
    from forge.data.mixture import MixtureCorpus

    seq, micro, batches = 256, 8, 300
    corpus = MemmapCorpus(**options(MemmapDataConfig, path=str(prepared), vocab_size=50257))
    windows = TokenWindows(corpus.train_tokens, seq)
    sources = {"a": {"path": str(prepared)}, "b": {"path": str(prepared), "weight": 1.0}}
    mixture = MixtureCorpus(**options(MixtureDataConfig, sources=sources, vocab_size=50257))
    loaders = {
        "memmap BatchLoader": BatchLoader(windows, micro, seed=0),
        "memmap + document masking (dense mask)": BatchLoader(windows, micro, seed=0, document_eos=corpus.eos_id),
        "mixture of 2 sources": mixture.make_loader(seq, micro, micro, seed=0),
    }
    rows = []
    for name, loader in loaders.items():

        def run(loader=loader):
            for _ in range(batches):
                batch_to_device(loader.next_batch(), "cpu")

        _, seconds = timed(run)
        rate = batches * micro * seq / seconds
        rows.append((name, rate, f"{rate / TRAINING_TOKENS_PER_S:,.0f}x training"))
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        prepare_rows, prepared = bench_prepare(Path(tmp))
        rows = prepare_rows + bench_loaders(prepared)
    print(f"{'what':<46} {'tokens/s':>12}  note")
    for name, rate, note in rows:
        print(f"{name:<46} {rate:>12,.0f}  {note}")
    print(f"{'default training run (llama_tiny, 2 CPU cores)':<46} {TRAINING_TOKENS_PER_S:>12,}  reference")


if __name__ == "__main__":
    main()
