"""forge-convert and load_pretrained against transformers' own LlamaForCausalLM."""

import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import forge
from forge.config import compose
from forge.train.trainer import Trainer
from tests.tiny import TINY_MODEL

TINY = [
    *TINY_MODEL,
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.dtype=fp32",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "scheduler.warmup_steps=1",
    "train.steps=3",
    "checkpoint.interval=3",
]


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forge.checkpoint.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def hf_logits(folder, tokens):
    with torch.no_grad():
        return LlamaForCausalLM.from_pretrained(folder).eval()(tokens).logits


def test_hf_folder_loads_with_matching_logits(hf_dir):
    tokens = torch.randint(0, 300, (2, 20))
    model = forge.load_pretrained(hf_dir)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_logits(hf_dir, tokens), rtol=1e-4, atol=1e-4)


def test_hf_to_dcp_to_hf_round_trip(hf_dir, tmp_path):
    assert convert("--to", "dcp", str(hf_dir), str(tmp_path / "dcp")).returncode == 0
    assert (tmp_path / "dcp/latest").is_file()
    tokens = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        ours = forge.load_pretrained(tmp_path / "dcp")(tokens)
    torch.testing.assert_close(ours, hf_logits(hf_dir, tokens), rtol=1e-4, atol=1e-4)
    result = convert("--to", "hf", str(tmp_path / "dcp"), str(tmp_path / "back"))
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(hf_logits(tmp_path / "back", tokens), ours, rtol=1e-4, atol=1e-4)


def test_trained_run_exports_to_transformers(tmp_path):
    Trainer(compose(TINY), tmp_path / "run").fit()
    result = convert("--to", "hf", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.decode(tokenizer("Good morrow, Juliet.")["input_ids"]) == "Good morrow, Juliet."
    assert tokenizer.eos_token == "<|endoftext|>"
    tokens = torch.randint(0, 8192, (2, 16))
    ours = forge.load_pretrained(tmp_path / "run")
    assert not ours.training
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path / "hf", tokens), ours(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt,name", [("torch", "model.pt"), ("safetensors", "model.safetensors")])
def test_consolidated_files_round_trip(hf_dir, tmp_path, fmt, name):
    from forge.checkpoint.cli import main as forge_convert  # in process: the command line is tested above

    assert forge_convert(["--to", fmt, str(hf_dir), str(tmp_path / name)]) == 0
    a, b = forge.load_pretrained(hf_dir), forge.load_pretrained(tmp_path / name)
    for (key, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), key


def test_warm_start_training_from_a_converted_hf_model(hf_dir, tmp_path):
    from forge.checkpoint.cli import main as forge_convert

    assert forge_convert(["--to", "dcp", str(hf_dir), str(tmp_path / "dcp")]) == 0
    trainer = Trainer(
        compose(
            [
                *TINY,
                "model.vocab_size=8192",
                "model.ffn_dim=96",
                f"checkpoint.load_weights={tmp_path / 'dcp'}",
                "checkpoint.load_weights_exclude=[tok_embeddings.,output.]",
            ]
        ),
        tmp_path / "run",
    )
    hf = LlamaForCausalLM.from_pretrained(hf_dir)
    torch.testing.assert_close(
        trainer.model.layers["1"].feed_forward.w2.weight, hf.model.layers[1].mlp.down_proj.weight
    )


def test_bad_sources_exit_non_zero_naming_them(tmp_path, capsys):
    from forge.checkpoint.cli import main as forge_convert

    assert forge_convert(["--to", "hf", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "missing does not exist" in capsys.readouterr().err
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    assert forge_convert(["--to", "hf", str(junk), str(tmp_path / "out")]) == 1
    assert "junk.pt" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_existing_destination_is_refused_unless_overwrite_and_nothing_half_written_stays(hf_dir, tmp_path, capsys):
    from forge.checkpoint.cli import main as forge_convert  # in process: the subprocess path is tested above

    out = tmp_path / "model.pt"
    assert forge_convert(["--to", "torch", str(hf_dir), str(out)]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert forge_convert(["--to", "torch", str(hf_dir), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{out} already exists" in err and "--overwrite" in err
    assert out.read_bytes() == before
    # A run directory as the destination of a dcp export: refused, so its own checkpoints stay what resume finds.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert forge_convert(["--to", "dcp", str(hf_dir), str(run)]) == 1
    assert "already exists (a folder)" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]
    # Not even with --overwrite may the destination be the source or hold it.
    assert forge_convert(["--to", "hf", str(hf_dir), str(hf_dir.parent), "--overwrite"]) == 1
    assert "is or holds the source" in capsys.readouterr().err and hf_dir.is_dir()
    # --overwrite replaces a folder with the whole new output.
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/stale.txt").write_text("old")
    assert forge_convert(["--to", "hf", str(hf_dir), str(tmp_path / "hf"), "--overwrite"]) == 0
    assert (tmp_path / "hf/config.json").is_file() and not (tmp_path / "hf/stale.txt").exists()
    assert not list(tmp_path.glob(".*staging*")) and not list(tmp_path.glob(".*replaced*"))


def test_a_hugging_face_folder_without_config_json_is_named(hf_dir, tmp_path, capsys):
    import shutil

    from forge.checkpoint.cli import main as forge_convert

    half = tmp_path / "half"
    shutil.copytree(hf_dir, half)
    (half / "config.json").unlink()
    assert forge_convert(["--to", "torch", str(half), str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert "no config.json" in err and str(half) in err
    assert not (tmp_path / "m.pt").exists()
