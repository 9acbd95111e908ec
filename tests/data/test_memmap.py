"""The memory-mapped shard corpus: one flat stream over several shards, split, checked against meta.json."""

import json

import numpy as np
import pytest

from forge.config.schema import MemmapDataConfig, options
from forge.data.loader import BatchLoader, TokenWindows
from forge.data.memmap import MemmapCorpus, TokenSpan
from forge.data.sources import DataError


def test_token_span_slices_across_arrays_like_one_array():
    arrays = [np.arange(0, 5), np.arange(5, 7), np.arange(7, 20)]
    flat = np.arange(20)
    span = TokenSpan(arrays)
    for lo, hi in [(0, 20), (3, 9), (5, 7), (6, 6), (4, 5), (18, 25)]:
        assert np.array_equal(span[lo:hi], flat[lo:hi])
    inner = span.span(3, 15)
    assert len(inner) == 12 and np.array_equal(inner[2:10], flat[5:13]) and inner[0] == 3
    assert np.array_equal(np.concatenate(inner.pieces()), flat[3:15])


def test_corpus_reads_every_shard_in_order_with_a_held_out_tail(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    whole = np.concatenate([np.load(prepared / s["file"]) for s in meta["shards"]])
    corpus = MemmapCorpus(**options(MemmapDataConfig, path=str(prepared), vocab_size=50257, val_fraction=0.1))
    assert len(meta["shards"]) > 3
    n_val = round(len(whole) * 0.1)
    assert np.array_equal(corpus.val_tokens[: len(corpus.val_tokens)], whole[-n_val:])
    assert len(corpus.train_tokens) == len(whole) - n_val
    windows = TokenWindows(corpus.train_tokens, seq_len=64)
    for index in (0, 108, 109, len(windows) - 1):  # samples that cross shard ends included
        assert np.array_equal(windows[index], whole[index * 64 : index * 64 + 65])
    assert corpus.eos_id == 50256 and corpus.tokenizer.decode(whole[:20].tolist()) in whole_text(corpus, whole)
    a, b = (BatchLoader(windows, 4, seed=7) for _ in range(2))
    assert all(np.array_equal(a.next_batch()[0], b.next_batch()[0]) for _ in range(5))


def whole_text(corpus, whole) -> str:
    return corpus.tokenizer.decode(whole[:200].tolist())


def test_vocab_mismatch_missing_and_corrupt_shards_are_named(prepared):
    with pytest.raises(DataError, match="data.vocab_size=8192"):
        MemmapCorpus(**options(MemmapDataConfig, path=str(prepared), vocab_size=8192))
    shard = prepared / "shard_00002.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(DataError, match="shard_00002.npy is corrupt"):
        MemmapCorpus(**options(MemmapDataConfig, path=str(prepared), vocab_size=50257))
    shard.unlink()
    with pytest.raises(DataError, match="shard_00002.npy listed in meta.json is missing"):
        MemmapCorpus(**options(MemmapDataConfig, path=str(prepared), vocab_size=50257))
    with pytest.raises(DataError, match="no meta.json"):
        MemmapCorpus(**options(MemmapDataConfig, path=str(prepared.parent), vocab_size=50257))


def test_a_shard_with_out_of_vocabulary_bytes_is_named_when_its_sample_is_read(prepared):
    """Same size, so the shard loads; the trainer's windows check each sample against data.vocab_size."""
    from forge.data.token_corpus import windows_of_split

    shard = prepared / "shard_00001.npy"
    tokens = np.load(shard)
    tokens[5] = 65000  # not a GPT-2 id (uint16 still holds it)
    np.save(shard, tokens)
    corpus = MemmapCorpus(**options(MemmapDataConfig, path=str(prepared), vocab_size=50257))
    windows = windows_of_split(corpus.train_tokens, 64, 50257, "training", str(prepared))
    first_of_shard_1 = len(np.load(prepared / "shard_00000.npy"))
    bad = (first_of_shard_1 + 5) // 64
    assert windows[bad - 1] is not None
    with pytest.raises(
        DataError, match=r"the training split of data.path=.*: token id 65000 .* \(data.vocab_size=50257\)"
    ):
        windows[bad]


def test_an_eos_id_outside_the_vocabulary_is_named(prepared):
    """With data.document_masking such an id used to mask nothing, silently: no token ever equals it."""
    meta_file = prepared / "meta.json"
    meta = json.loads(meta_file.read_text())
    for eos in (50257, -1, None):
        meta_file.write_text(json.dumps(meta | {"eos_id": eos}))
        with pytest.raises(
            DataError, match=rf"{meta_file}: eos_id={eos} is not a token of the vocabulary \(0..50256\)"
        ):
            MemmapCorpus(**options(MemmapDataConfig, path=str(prepared), vocab_size=50257, document_masking=True))
