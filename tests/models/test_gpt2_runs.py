"""GPT-2 end to end through the generic machinery, which knows it only by its spec: it trains on the embedded corpus,
fsdp / tp2 / cp2 / tp2 x fsdp2 / tp2 x cp2 on gloo ranks match one process, a Hugging Face folder transformers wrote
warm starts it with transformers' logits, its save_hf export loads in transformers with forge's logits, and `--plan` /
`--plan --search` cost it."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from forge.checkpoint.convert import load_pretrained
from forge.checkpoint.hf_load import load_hf_into
from forge.config import compose
from forge.generate.load import run_config_of, tokenizer_of
from forge.train.build import build_meta_model, materialize
from tests.conftest import ROOT, forge_cmd
from tests.parallel.harness import launch
from tests.parallel.scenarios import run_scenarios

GPT2 = ["model=gpt2_tiny"]
RTOL = 1e-4  # fp32; the ranks add the same products in another order (~1e-7 seen)
EPS = torch.finfo(torch.float32).eps
ULPS = 64  # fp32 logits of two implementations of the same sums (see tests/models/test_gpt2.py)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(run_scenarios, 1, {"one": [*GPT2, "parallel=single"]}, str(tmp_path_factory.mktemp("one")))[0]


def assert_same_curves(got: dict, want: dict) -> None:
    assert len(got["loss"]) == len(want["loss"]) == 4
    for key in ("loss", "grad_norm", "val_loss"):
        assert got[key] == pytest.approx(want[key], rel=RTOL), key


def test_it_trains_on_the_embedded_corpus(reference):
    """The one-process reference itself: the loss falls over its 4 steps (lr 3e-3, warmup 2)."""
    losses = reference["one"]["loss"]
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.dist
def test_fsdp_tp2_and_cp2_match_one_process(reference, tmp_path):
    """Two gloo ranks: FSDP shards the fused projection's rows; tp2 splits its heads (the family's own plan); cp2
    splits each sequence, the positions and the keys each rank attends over following it."""
    layouts = {"fsdp": [*GPT2, "parallel=fsdp"], "tp2": [*GPT2, "parallel=tp2"], "cp2": [*GPT2, "parallel=cp2"]}
    runs = launch(run_scenarios, 2, layouts, str(tmp_path))[0]
    assert runs["fsdp"]["wq_placements"] == ["S(0)"]
    assert runs["tp2"]["wq_placements"] == ["S(2)"]  # c_attn (dim, q/k/v, dim): each rank its heads of each
    # cp2: each rank half of every sequence, its attention layers gathering the keys (the family's gather_kv slot)
    for name in layouts:
        assert runs[name]["local_params"] < 0.7 * runs[name]["params"], name
        assert_same_curves(runs[name], reference["one"])


@pytest.mark.dist
def test_tp2_fsdp_and_tp2_cp2_match_one_process(reference, tmp_path):
    layouts = {"tp2_fsdp": [*GPT2, "parallel=tp2_fsdp"], "tp2_cp2": [*GPT2, "parallel=cp2", "parallel.tp=2"]}
    runs = launch(run_scenarios, 4, layouts, str(tmp_path))[0]
    assert runs["tp2_fsdp"]["wq_placements"] == ["S(0)", "S(2)"]
    assert runs["tp2_cp2"]["wq_placements"][-1] == "S(2)"
    for name in layouts:
        assert runs[name]["local_params"] < 0.4 * runs[name]["params"], name
        assert_same_curves(runs[name], reference["one"])


def transformers_gpt2(vocab: int) -> GPT2LMHeadModel:
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=256, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # off their initial values: biases start at zero, LayerNorms at one
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ULPS * EPS * theirs.abs().max().item())


def test_a_folder_transformers_wrote_loads_with_its_logits(tmp_path):
    """save_pretrained's folder, read by forge-convert's loader and by a run's warm start (the box reader)."""
    cfg = compose([*GPT2, "train.dtype=fp32"])
    hf = transformers_gpt2(cfg.data.vocab_size)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = torch.randint(0, cfg.data.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        assert_logits_close(load_pretrained(tmp_path / "hf")(tokens), want)
        model = build_meta_model(cfg)
        materialize(model, torch.device("cpu"), seed=3)
        load_hf_into(model, tmp_path / "hf")
        assert_logits_close(model.eval()(tokens), want)


def test_the_run_exports_a_folder_transformers_loads(tmp_path):
    """`forge-train model=gpt2_tiny checkpoint.save_hf=true` as a user types it (steps shortened): transformers'
    from_pretrained gives the logits of forge's own model from the run's checkpoint, and forge-generate on the run
    gives transformers' greedy tokens."""
    run_dir = tmp_path / "run"
    cmd = forge_cmd(*GPT2, "train.steps=3", "train.dtype=fp32", "train.eval_batches=1", "checkpoint.save_final=true",
                    "checkpoint.save_hf=true", f"hydra.run.dir={run_dir}")  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    exported = next(p.parent for p in run_dir.rglob("config.json") if (p.parent / "model.safetensors").is_file())
    assert json.loads((exported / "config.json").read_text())["model_type"] == "gpt2"
    hf = GPT2LMHeadModel.from_pretrained(exported).eval()
    ours = load_pretrained(run_dir)
    tokens = torch.randint(0, ours.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_logits_close(ours(tokens), hf(tokens).logits)
    # forge-generate on the run decodes what transformers' greedy search on the export does
    prompt = "ROMEO. O, she doth"
    gen = subprocess.run([sys.executable, "-m", "forge.generate.cli", f"checkpoint={run_dir}", f"prompt={prompt!r}",
                          "max_new_tokens=10", "format=jsonl", "stop_at_eos=false"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-2000:]
    tokenizer, _ = tokenizer_of(run_dir, run_config_of(run_dir))
    ids = tokenizer.encode(prompt).ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert json.loads(gen.stdout.splitlines()[0])["tokens"] == theirs[0, len(ids) :].tolist()


def test_plan_and_search_cost_it(tmp_path):
    """--plan prints the family's FLOPs (its cost) for GPT-2 small on 64 ranks; the search proposes only the
    dimensions the family runs (tp, cp, data parallelism), and its winner validates."""
    plan = subprocess.run(forge_cmd("model=gpt2_124m", "parallel.world_size=64", "train.seq_len=1024", "--plan",
                                    f"hydra.run.dir={tmp_path}"), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "model 0.124B parameters" in plan.stdout
    dim, layers, vocab, seq = 768, 12, 50257, 1024
    forward = layers * (2 * 4 * dim * dim + 2 * 2 * dim * seq + 2 * 2 * dim * 4 * dim) + 2 * dim * vocab
    assert f"forward {forward / 1e9:.2f} GFLOP" in plan.stdout
    search = subprocess.run(forge_cmd("model=gpt2_124m", "parallel.world_size=64", "--plan", "--search",
                                      f"hydra.run.dir={tmp_path}"), cwd=ROOT, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert search.returncode == 0, search.stderr[-2000:]
    rows = [line for line in search.stdout.splitlines() if " pp" in line and " ep" in line]
    assert rows and all(" pp1 ep1 " in row for row in rows), rows
    assert any(" tp2 " in row or " tp4 " in row for row in rows), rows
