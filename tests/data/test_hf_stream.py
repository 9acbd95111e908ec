"""data=hf: a `datasets` split tokenised on the fly, in memory and streaming, resumable at any dp size."""

import json

import numpy as np
import pytest

from forge.config import compose
from forge.config.schema import HFDataConfig, options
from forge.data.hf_stream import HFDatasetCorpus
from forge.data.sources import DataError
from forge.data.tokenizer import gpt2_tokenizer, train_bpe
from forge.train.trainer import Trainer
from tests.checkpoint.test_resume import TINY
from tests.tiny import Crash, CrashingTrainer, losses

SEQ, MICRO = 32, 2


@pytest.fixture
def jsonl(tmp_path, scenes):
    """20 scenes as a jsonl file (a `story` field, to exercise text_field)."""
    path = tmp_path / "plays.jsonl"
    with path.open("w") as f:
        for scene in scenes[:20]:
            f.write(json.dumps({"story": scene}) + "\n")
    return path


def corpus(path, **kwargs) -> HFDatasetCorpus:
    kwargs = {"text_field": "story", "val_documents": 2, **kwargs}
    return HFDatasetCorpus(**options(HFDataConfig, dataset=str(path), vocab_size=50257, **kwargs))


def batches(loader, n: int) -> list[list[list[int]]]:
    return [loader.next_batch()[0].tolist() for _ in range(n)]


@pytest.mark.parametrize("streaming", [False, True])
def test_unshuffled_stream_is_the_documents_tokenised_and_packed(jsonl, scenes, streaming):
    tok = gpt2_tokenizer()
    flat = np.concatenate([tok.encode(s).ids + [50256] for s in scenes[2:20]])
    loader = corpus(jsonl, streaming=streaming, shuffle=False).make_loader(SEQ, MICRO, MICRO, 0, 0, 1)
    for b in range(30):
        inputs, labels = loader.next_batch()
        for i in range(MICRO):
            start = (b * MICRO + i) * SEQ
            assert inputs[i].tolist() == flat[start : start + SEQ].tolist()
            assert labels[i].tolist() == flat[start + 1 : start + SEQ + 1].tolist()
    val = corpus(jsonl, streaming=streaming).val_tokens
    assert val.tolist() == [t for s in scenes[:2] for t in tok.encode(s).ids + [50256]]


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_and_other_dp_sizes_continue_the_same_global_order(jsonl, streaming):
    source = corpus(jsonl, streaming=streaming, shuffle_buffer=8)
    n_tokens = sum(len(source.encode([d])) for d in source.training_documents(0, 0, 0))
    n_batches = n_tokens // (2 * MICRO * SEQ) + 5  # runs into the second epoch
    whole = batches(source.make_loader(SEQ, 2 * MICRO, 2 * MICRO, 7, 0, 1), n_batches)
    first = source.make_loader(SEQ, 2 * MICRO, 2 * MICRO, 7, 0, 1)
    head = batches(first, 6)
    state = first.state_dict()
    assert head == whole[:6]
    again = source.make_loader(SEQ, 2 * MICRO, 2 * MICRO, 7, 0, 1)
    again.load_state_dict(state)
    assert batches(again, n_batches - 6) == whole[6:]
    assert again.epoch == 1
    ranks = []
    for rank in range(2):
        loader = source.make_loader(SEQ, MICRO, 2 * MICRO, 7, rank, 2)
        loader.load_state_dict(state)
        ranks.append(batches(loader, n_batches - 6))
    assert [a + b for a, b in zip(*ranks, strict=True)] == whole[6:]


def test_epochs_reshuffle_and_seeds_differ(jsonl):
    source = corpus(jsonl)
    epoch0, epoch1 = list(source.training_documents(0, 7, 0)), list(source.training_documents(1, 7, 0))
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    assert list(source.training_documents(0, 8, 0)) != epoch0


def test_bad_input_names_the_field_file_and_setting(jsonl, tmp_path):
    with pytest.raises(DataError, match="no text field 'text'"):
        HFDatasetCorpus(**options(HFDataConfig, dataset=str(jsonl), vocab_size=50257))
    with pytest.raises(DataError, match="nowhere.jsonl"):
        corpus(tmp_path / "nowhere.jsonl")
    with pytest.raises(DataError, match="data.vocab_size=512"):
        HFDatasetCorpus(**options(HFDataConfig, dataset=str(jsonl), vocab_size=512, text_field="story"))
    for streaming in (False, True):  # a stream used to be refused only at the first training batch
        with pytest.raises(DataError, match="no training documents: data.val_documents=20 holds out all 20 records"):
            corpus(jsonl, val_documents=20, streaming=streaming)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_line_that_is_not_utf8_is_named_by_file_and_line(jsonl, streaming):
    """`datasets` raised a bare UnicodeDecodeError (a traceback) while iterating, naming neither."""
    lines = jsonl.read_bytes().splitlines(keepends=True)
    jsonl.write_bytes(b"".join(lines[:5]) + b'{"story": "bad \xff"}\n' + b"".join(lines[5:]))
    source = corpus(jsonl, streaming=streaming, shuffle=False)  # the validation documents decode
    with pytest.raises(DataError, match=f"{jsonl}:6: not valid UTF-8"):
        batches(source.make_loader(SEQ, MICRO, MICRO, 0, 0, 1), 200)


def test_a_text_field_that_is_not_a_string_is_named(tmp_path):
    path = tmp_path / "numbers.jsonl"
    path.write_text("".join(f'{{"story": {i}}}\n' for i in range(5)))
    with pytest.raises(DataError, match="text field 'story' holds int, not a string"):
        corpus(path, streaming=True)


def test_training_on_a_streamed_dataset_resumes_bit_for_bit(jsonl, tmp_path, scenes):
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(scenes, 512).save(str(tokenizer))
    data = ["data=hf", f"data.dataset={jsonl}", "data.text_field=story", "data.streaming=true", "data.val_documents=2"]
    data += [f"data.tokenizer={tokenizer}", "data.vocab_size=512", "model.vocab_size=512"]
    overrides = [*TINY, *data, "checkpoint.interval=4"]
    Trainer(compose(overrides), tmp_path / "whole").fit()
    with pytest.raises(Crash):
        CrashingTrainer(compose(overrides), tmp_path / "cut").fit()
    Trainer(compose(overrides), tmp_path / "cut").fit()
    whole, cut = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert sorted(cut) == list(range(1, 13))
    assert [cut[s] for s in range(1, 13)] == [whole[s] for s in range(1, 13)]
    assert whole[12] < whole[1]
