"""forge-generate and forge-eval on a tiny trained run, against independent computations: as subprocesses where
the command line is what is tested, in process otherwise."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import forge
from forge.config import compose
from forge.generate.engine import generate
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
    "train.eval_batches=3",
    "scheduler.warmup_steps=1",
    "train.steps=5",
    "checkpoint.interval=5",
]


def run(module: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=180, input=stdin
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    summary = Trainer(compose(TINY), folder).fit()
    return folder, summary


def test_generate_greedy_batch_matches_the_engine_in_process(run_dir, corpus):
    folder, _ = run_dir
    prompts = ["ROMEO. O, she doth", "To be"]
    result = run(
        "forge.generate.cli",
        f"checkpoint={folder}",
        f"prompt=[{prompts[0]!r}, {prompts[1]!r}]",
        "max_new_tokens=12",
        "format=jsonl",
        "stop_at_eos=false",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    model = forge.load_pretrained(folder)
    ids = [corpus.tokenizer.encode(p).ids for p in prompts]
    expected = generate(model, ids, 12)
    assert [line["tokens"] for line in lines] == expected
    assert [line["prompt"] for line in lines] == prompts
    assert lines[0]["completion"] == corpus.tokenizer.decode(expected[0])


def test_generate_seeded_sampling_is_reproducible_and_interactive_reads_stdin(run_dir):
    folder, _ = run_dir
    args = (f"checkpoint={folder}", "max_new_tokens=10", "temperature=1.0", "top_k=50", "top_p=0.95", "seed=3")
    a = run("forge.generate.cli", *args, "prompt=KING.", "format=jsonl")
    b = run("forge.generate.cli", *args, "interactive=true", "format=jsonl", stdin="KING.\n\nQUEEN.\n")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    first, *rest = [json.loads(line) for line in b.stdout.splitlines()]
    assert json.loads(a.stdout) == first
    assert [r["prompt"] for r in rest] == ["QUEEN."]
    text = run("forge.generate.cli", *args, "prompt=KING.")
    assert text.stdout.startswith("KING." + first["completion"])


def test_generate_on_an_hf_export_with_a_given_tokenizer(run_dir, tmp_path, corpus, capsys):
    from forge.checkpoint.cli import main as forge_convert
    from forge.generate.cli import main as forge_generate  # in process: the command line is tested above

    folder, _ = run_dir
    assert forge_convert(["--to", "hf", str(folder), str(tmp_path / "hf")]) == 0
    tokenizer = corpus.folder / "tokenizer.json"
    capsys.readouterr()
    hf = [f"checkpoint={tmp_path / 'hf'}", "prompt=KING.", "format=jsonl", f"tokenizer={tokenizer}"]
    assert forge_generate(hf) == 0
    a = capsys.readouterr().out
    assert forge_generate([f"checkpoint={folder}", "prompt=KING.", "format=jsonl"]) == 0
    b = capsys.readouterr().out
    assert json.loads(a)["tokens"] == json.loads(b)["tokens"]


def test_generate_bad_checkpoint_and_bad_key_fail_with_a_message(tmp_path, capsys):
    from forge.generate.cli import main as forge_generate

    assert forge_generate([f"checkpoint={tmp_path / 'missing'}", "prompt=x"]) == 1
    assert "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        forge_generate([f"checkpoint={tmp_path}", "prompt=x", "temprature=1"])
    assert "temprature" in str(exit_.value)


def test_eval_perplexity_is_exp_of_hand_computed_loss(run_dir, corpus):
    folder, summary = run_dir
    result = run("forge.generate.evaluate", f"checkpoint={folder}")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    model = forge.load_pretrained(folder)
    tokens = torch.from_numpy(corpus.val_tokens[: 3 * 4 * 32 + 1].astype("int64"))
    losses = []
    with torch.no_grad():
        for b in range(3):
            rows = torch.stack([tokens[(b * 4 + r) * 32 : (b * 4 + r) * 32 + 33] for r in range(4)])
            logits = model(rows[:, :-1])
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)))
    loss = torch.stack(losses).mean().item()
    assert out["batches"] == 3 and out["tokens"] == 3 * 4 * 32
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    assert out["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    # the trainer's final in-training eval is the same function over the same batches
    assert out["loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)


def test_eval_options_override_the_run_config(run_dir, capsys):
    from forge.generate.evaluate import main as forge_eval

    folder, _ = run_dir
    assert forge_eval([f"checkpoint={folder}", "batches=1", "seq_len=16", "micro_batch_size=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["batches"], out["tokens"]) == (1, 32)


def test_eval_captures_activations(run_dir, tmp_path):
    from safetensors.torch import load_file

    from forge.generate.evaluate import main as forge_eval

    folder, _ = run_dir
    path = tmp_path / "acts.safetensors"
    assert forge_eval([f"checkpoint={folder}", "batches=2", "capture=[layers.*,norm]", f"capture_out={path}"]) == 0
    acts = load_file(str(path))
    assert set(acts) == {"layers.0", "layers.1", "norm"}
    assert acts["layers.1"].shape == (8, 32, 64)


def test_generate_takes_a_prompt_as_typed_and_a_bracketed_one_as_a_list():
    from forge.generate.cli import split_prompts

    assert split_prompts(["checkpoint=x", "prompt=ROMEO:", "top_k=3"]) == (["checkpoint=x", "top_k=3"], ["ROMEO:"])
    assert split_prompts(["prompt=3"])[1] == ["3"]
    assert split_prompts(["prompt=key: value"])[1] == ["key: value"]
    assert split_prompts(["prompt=[KING., QUEEN.]"])[1] == ["KING.", "QUEEN."]
    assert split_prompts(["prompt=[INST] hi [/INST]"])[1] == ["[INST] hi [/INST]"]  # not a YAML list: verbatim
    assert split_prompts(["prompt=[ROMEO:, x]"])[1] == ["[ROMEO:, x]"]  # a list of mappings is not a prompt list
    assert split_prompts(["checkpoint=x"]) == (["checkpoint=x"], None)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("top_p=0", "top_p=0.0 must be in (0, 1]"),
        ("max_new_tokens=-3", "max_new_tokens=-3 must be at least 1"),
        ("temperature=-1", "temperature=-1.0 must be >= 0"),
        ("top_k=-2", "top_k=-2 must be >= 0"),
        ("format=xml", "format='xml' is not one of text, jsonl"),
    ],
)
def test_generate_refuses_impossible_sampling_options_before_loading(tmp_path, option, message):
    from forge.generate.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([f"checkpoint={tmp_path / 'never-read'}", "prompt=x", option])
    assert str(exit_.value).startswith(f"forge-generate: {message}")


def test_eval_refuses_zero_sizes_and_a_seq_len_beyond_the_model(run_dir, capsys):
    from forge.generate.evaluate import main as forge_eval  # in process: the subprocess path is tested above

    folder, _ = run_dir
    assert forge_eval([f"checkpoint={folder}", "batches=0"]) == 1
    assert "forge-eval: batches=0 must be at least 1" in capsys.readouterr().err
    assert forge_eval([f"checkpoint={folder}", "seq_len=4096"]) == 1
    assert "seq_len=4096 exceeds the model's max_seq_len=" in capsys.readouterr().err
    assert forge_eval([f"checkpoint={folder}", "data=memmap", "data_overrides=[data.path=/nope]"]) == 1
    err = capsys.readouterr().err
    assert "data.vocab_size is not set and cannot be read from data.path=/nope" in err and "Traceback" not in err


NEGATIVE_EPS = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300,
    "intermediate_size": 128, "rms_norm_eps": -1.0,
}  # fmt: skip
"""An HF config.json whose values parse but fall outside their fields' domains (forge.domain)."""


@pytest.mark.parametrize(
    ("make_source", "message"),
    [
        (lambda d: (d / "w.safetensors").write_bytes(b"\xff" * 64), "w.safetensors is not a readable safetensors"),
        (lambda d: (d / "hf/config.json").write_text('{"model_type": "llama",\n'), "config.json:2: not valid JSON"),
        (lambda d: (d / "hf/config.json").write_text('{"model_type": "llama"}'), "lacks 'num_attention_heads'"),
        (lambda d: (d / "hf/config.json").write_text("[1, 2]"), "is not a model config"),
        (lambda d: (d / "hf/config.json").write_text(json.dumps(NEGATIVE_EPS)), "gives model.norm_eps=-1.0 must be"),
    ],
)
def test_garbage_weights_or_hf_config_is_one_line_naming_the_file(tmp_path, capsys, make_source, message):
    """forge-generate and forge-convert read these through load_any; each used to end in a traceback."""
    from forge.checkpoint.cli import main as forge_convert
    from forge.checkpoint.errors import CheckpointError

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/model.safetensors").write_bytes(b"\xff" * 64)
    make_source(tmp_path)
    source = tmp_path / ("w.safetensors" if (tmp_path / "w.safetensors").exists() else "hf")
    with pytest.raises(CheckpointError, match=message):
        forge.load_pretrained(source)
    assert forge_convert(["--to", "torch", str(source), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.split(":")[0] in err and "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()
