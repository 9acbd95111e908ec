"""forge-generate on a trained VLM checkpoint: the answer equals a greedy decode done by hand with the model."""

import json
import subprocess
import sys

import pytest
import torch

from forge.data.tokenizer import package_dir
from forge.generate.vlm import load_vlm
from tests.conftest import ROOT
from tests.vlm.scenarios import train

ANSWERS = set((package_dir("easy_vqa") / "data" / "answers.txt").read_text().split())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    run = tmp_path_factory.mktemp("vlm-run")
    train(str(run), "vlm=joint_decoder", "train.steps=30", "train.threads=0", "checkpoint.interval=30")
    return str(run)


def test_generated_answer_is_the_greedy_decode_and_a_real_answer(trained):
    image = package_dir("easy_vqa") / "data" / "test" / "images" / "0.png"
    prompt = "what color is the shape?"
    cmd = [
        sys.executable,
        "-m",
        "forge.generate.cli",
        f"checkpoint={trained}",
        f"image={image}",
        f"prompt={prompt}",
        "max_new_tokens=4",
        "format=jsonl",
        "device=cpu",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    model, corpus, _ = load_vlm(trained, torch.device("cpu"))
    example = corpus.example(type(corpus.train_records[0])(str(image), prompt, ""), 1)
    ids = corpus.tokenizer.encode(prompt).ids
    expected = []
    with torch.no_grad():
        for _ in range(4):
            logits = model(
                torch.tensor([ids + expected]),
                example["pixels"][None],
                example["frame_mask"][None],
                example["frame_times"][None],
            )
            token = int(logits[0, -1].argmax())
            if token == corpus.eos_id:
                break
            expected.append(token)
    assert result["tokens"] == expected
    assert result["completion"].split()[0] in ANSWERS  # it learned to answer with one of easy-vqa's answers


def test_bad_media_and_text_checkpoints_are_refused(trained, tmp_path, capsys):
    from forge.generate.cli import main as forge_generate  # in process: the command line is tested above

    assert forge_generate([f"checkpoint={trained}", f"image={tmp_path / 'no.png'}", "prompt=what?", "device=cpu"]) == 1
    assert "no.png" in capsys.readouterr().err
