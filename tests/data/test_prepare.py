"""forge-prepare-data on real files: exact token streams, reuse, refusal, and one clear error per bad input."""

import json
import os

import numpy as np
import pytest

from forge.data.prepare import prepare
from forge.data.sources import DataError
from forge.data.tokenizer import gpt2_tokenizer
from tests.data.conftest import prepare_cmd, prepare_config


def expected_stream(docs: list[str], tokenizer, eos_id: int) -> np.ndarray:
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc, add_special_tokens=False).ids)
        ids.append(eos_id)
    return np.asarray(ids)


def read_shards(out) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.load(out / s["file"]) for s in meta["shards"]])


def snapshot(folder) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}


def test_jsonl_parquet_text_to_gpt2_shards_then_reuse_then_refuse(tmp_path, inputs, scenes):
    out = tmp_path / "out"
    globs = f"inputs=[{inputs}/a.jsonl,{inputs}/b.parquet,{inputs}/c*.txt]"
    result = prepare_cmd(globs, f"out_dir={out}", "shard_tokens=20000")
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 50257 and meta["eos_id"] == 50256
    assert meta["documents"] == 60 and len(meta["shards"]) > 1
    assert all(s["tokens"] == 20000 for s in meta["shards"][:-1])
    tokens = read_shards(out)
    assert tokens.dtype == np.uint16 and len(tokens) == meta["tokens"]
    assert np.array_equal(tokens, expected_stream(scenes, gpt2_tokenizer(), 50256))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging folder left behind"

    before = snapshot(out)
    files = [f"{inputs}/a.jsonl", f"{inputs}/b.parquet", f"{inputs}/c*.txt"]
    assert prepare(prepare_config(inputs=files, out_dir=str(out), shard_tokens=20000)) == (meta, True)
    refused = prepare_cmd(globs, f"out_dir={out}", "shard_tokens=20000", "tokenizer=bpe", "vocab_size=512")
    assert refused.returncode == 2
    assert "tokenizer" in refused.stderr and str(out) in refused.stderr and "Traceback" not in refused.stderr
    assert snapshot(out) == before


def test_missing_file_exits_2_naming_it_and_writes_nothing(tmp_path):
    result = prepare_cmd(f"inputs=[{tmp_path}/nope/*.jsonl]", f"out_dir={tmp_path / 'out'}")
    assert result.returncode == 2
    assert "nope/*.jsonl" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("make_input", "overrides", "message"),
    [
        (lambda d: (d / "e.jsonl").write_text("\n"), {}, "empty corpus"),
        (lambda d: (d / "w.jsonl").write_text('{"body": "x"}\n'), {}, "no text field 'text' (has: body)"),
        (lambda d: (d / "p.jsonl").write_text('{"text": "x"}\n{oops\n'), {}, "p.jsonl:2: not a JSON line"),
        (lambda d: (d / "t.jsonl").write_text('{"text": "x"}\n'), {"tokenizer": "/no/such/tok"}, "/no/such/tok"),
        (lambda d: (d / "u.csv").write_text("x\n"), {}, "unknown file type"),
        (
            lambda d: (d / "v.jsonl").write_text('{"text": "x"}\n'),
            {"tokenizer": "bpe", "vocab_size": 0},
            "vocab_size=0",
        ),
        (
            lambda d: (d / "n.jsonl").write_text('{"text": "x"}\n{"text": null}\n'),
            {},
            "n.jsonl:2: text field 'text' is null",
        ),
        (lambda d: (d / "i.jsonl").write_text('{"text": 12}\n'), {}, "i.jsonl:1: text field 'text' is a number"),
        (lambda d: (d / "o.jsonl").write_text('{"text": {"a": 1}}\n'), {}, "o.jsonl:1: text field 'text' is an object"),
        (lambda d: (d / "b.jsonl").write_bytes(b'{"text": "x"}\n{"text": "\xff"}\n'), {}, "b.jsonl:2: not valid UTF-8"),
        (lambda d: (d / "b.txt").write_bytes(b"one\ntwo \xfe\n"), {}, "b.txt:2: not valid UTF-8 .byte 0xfe at byte 5"),
    ],
)
def test_bad_input_names_the_problem_and_leaves_no_output(tmp_path, make_input, overrides, message):
    make_input(tmp_path)
    (name,) = [p.name for p in tmp_path.iterdir()]
    cfg = prepare_config(inputs=[str(tmp_path / name)], out_dir=str(tmp_path / "out"), **overrides)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_file_named_twice_or_reached_through_a_symlink_loop_is_read_once(tmp_path, inputs, caplog):
    """`**` walks round a symlink loop (each file used to be read once per lap, until the path was too long)."""
    (inputs / "loop").symlink_to(inputs)
    files = [str(inputs / "**" / "*.jsonl"), str(inputs / "a.jsonl")]
    with caplog.at_level("WARNING"):
        meta, _ = prepare(prepare_config(inputs=files, out_dir=str(tmp_path / "out")))
    read = [f["file"] for f in meta["request"]["sources"]["files"]]
    assert meta["documents"] == 30 and read == [str(inputs / "a.jsonl")]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "more than once" in warnings[0] and str(inputs / "a.jsonl") in warnings[0]


def test_an_out_dir_that_cannot_be_created_is_named(tmp_path, inputs):
    cfg = prepare_config(inputs=[str(inputs / "a.jsonl")], out_dir="/proc/forge-out")
    with pytest.raises(DataError, match="cannot create out_dir=/proc/forge-out"):
        prepare(cfg)


def test_corrupt_shard_is_named_on_reuse(tmp_path, inputs):
    cfg = prepare_config(inputs=[str(inputs / "a.jsonl")], out_dir=str(tmp_path / "out"), shard_tokens=5000)
    meta, reused = prepare(cfg)
    assert not reused
    shard = tmp_path / "out" / meta["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"shard {shard} is corrupt"):
        prepare(cfg)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(DataError, match=f"shard {shard} is corrupt"):
        prepare(cfg)


def test_non_output_folder_is_not_overwritten(tmp_path, inputs):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not a prepared output"):
        prepare(prepare_config(inputs=[str(inputs / "a.jsonl")], out_dir=str(out)))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_trained_bpe_hf_folder_and_streaming_dataset(tmp_path, inputs, scenes):
    from transformers import PreTrainedTokenizerFast

    meta, _ = prepare(
        prepare_config(inputs=[str(inputs / "*.jsonl")], out_dir=str(tmp_path / "bpe"), tokenizer="bpe", vocab_size=600)
    )
    assert meta["vocab_size"] == 600 and meta["documents"] == 30 and meta["dtype"] == "uint16"

    folder = tmp_path / "hf_tok"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "bpe" / "tokenizer.json"), eos_token="<|endoftext|>")
    hf.save_pretrained(folder)
    cfg = prepare_config(
        dataset=str(inputs / "b.parquet"), streaming=True, tokenizer=str(folder), out_dir=str(tmp_path / "ds")
    )
    meta, _ = prepare(cfg)
    assert meta["documents"] == 20
    tokens = read_shards(tmp_path / "ds")
    expected = expected_stream(scenes[30:50], hf.backend_tokenizer, meta["eos_id"])
    assert np.array_equal(tokens, expected)


def test_large_vocab_uses_uint32(tmp_path, inputs):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "</s>": 70_001}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "big.json"))
    (tmp_path / "d.jsonl").write_text('{"text": "w69999 w1 zzz"}\n')
    meta, _ = prepare(
        prepare_config(
            inputs=[str(tmp_path / "d.jsonl")], tokenizer=str(tmp_path / "big.json"), out_dir=str(tmp_path / "out")
        )
    )
    assert meta["dtype"] == "uint32" and meta["eos_id"] == 70_001
    assert read_shards(tmp_path / "out").tolist() == [69_999, 1, 70_000, 70_001]
    assert os.path.exists(tmp_path / "out" / "tokenizer.json")
