"""parallel.cuda_graphs: the compiled blocks (or whole forward) replayed as CUDA graphs in one GPU process
(forge.parallel.plan).

On a CPU: the refusals (exit 2, one line), the blocks or the whole forward compiled in reduce-overhead mode
(inductor counts the graphs it cannot replay on a CPU) with the step marker each forward of the whole model sets
(the bf16 weight copies at fixed addresses that replay needs: tests/train/test_compute_weights.py). On a GPU
(skipped without one; benchmarks/gpu.sh runs it as its gpu_tests step, beside the measured small_cuda_graphs
runs): a short run with the graphs replayed, by blocks and as one graph, follows the same run without them.
"""

import copy
import importlib
import subprocess

import pytest
import torch

from forge.config import ConfigError, compose, validate
from forge.models.llama import TransformerArgs, build_transformer
from forge.parallel.plan import apply_compile
from tests.conftest import ROOT, forge_cmd, one_line
from tests.tiny import TINY_MODEL

RULES = importlib.import_module("forge.config.validate")  # the module (forge.config.validate is also the function)
GRAPHS = ["parallel.cuda_graphs=true", "parallel.compile=true", "train.device=cuda"]
REFUSED = {  # name -> (overrides, world size, the words of the refusal)
    "no compile": (["parallel.cuda_graphs=true", "parallel.compile=false"], 1, "parallel.compile=false"),
    "two processes": (GRAPHS, 2, "a world of 2 processes"),
    "activation checkpointing": ([*GRAPHS, "parallel.activation_checkpoint=full"], 1, "activation_checkpoint=full"),
    "fp8": ([*GRAPHS, "parallel.fp8=true"], 1, "parallel.fp8=true"),
    "moe": ([*GRAPHS, "model=moe_tiny"], 1, "an MoE model"),
    "cpu": (["parallel.cuda_graphs=true", "parallel.compile=true", "train.device=cpu"], 1, "train.device=cpu"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_validation_refuses(name):
    overrides, world, words = REFUSED[name]
    with pytest.raises(ConfigError, match="parallel.cuda_graphs=true with .* is not supported") as refused:
        validate(compose(overrides), world_size=world)
    assert words in str(refused.value)


def test_a_vlm_is_refused_by_name():
    """The graphs' rule names the VLM before VLMs' own refusal of parallel.compile."""
    with pytest.raises(ConfigError, match="parallel.cuda_graphs=true with a VLM is not supported"):
        validate(compose([*GRAPHS, "vlm=joint_decoder", "data=vqa_embedded"]), world_size=1)


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_the_device_is_read_as_the_run_will(monkeypatch, device):
    """train.device=auto means the CPU where CUDA is not available (refused), a GPU where it is (accepted)."""
    overrides = ["parallel.cuda_graphs=true", "parallel.compile=true", f"train.device={device}"]
    monkeypatch.setattr(RULES, "cuda_available", lambda: False)
    if device == "auto":
        with pytest.raises(ConfigError, match="with train.device=auto .CUDA graphs need a GPU"):
            validate(compose(overrides), world_size=1)
    monkeypatch.setattr(RULES, "cuda_available", lambda: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    validate(compose(overrides), world_size=1)  # a dense model, one process, compiled: accepted


def test_the_command_line_refuses_in_one_line(tmp_path):
    cmd = forge_cmd(
        "parallel.cuda_graphs=true", "train.device=cpu", "parallel.compile=true", f"hydra.run.dir={tmp_path}"
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "parallel.cuda_graphs=true with train.device=cpu" in one_line(proc)


ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, max_seq_len=32)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's compiles from scratch: dynamo keeps at most 8 entries per code object (Transformer.forward's,
    shared by every model this process compiles) and runs past them eagerly, without failing."""
    torch._dynamo.reset()


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_each_forward_of_the_model_begins_one_graph_step(monkeypatch, scope):
    from torch._dynamo.utils import counters

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = build_transformer(ARGS)
    reference = copy.deepcopy(model)
    counters["inductor"]["cudagraph_skips"] = 0
    applied = apply_compile(model, cuda_graphs=True, scope=scope)
    assert "replayed as CUDA graphs" in applied.detail
    if scope == "blocks":
        assert all(type(block).__name__ == "OptimizedModule" for block in model.layers.values())
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for micro_batch in range(3):  # gradient accumulation: one step of graphs per micro-batch's forward
        model(tokens).float().sum().backward()
        assert len(marks) == micro_batch + 1
    # reduce-overhead mode reached inductor, which replays nothing on a CPU and says so
    assert counters["inductor"]["cudagraph_skips"] > 0
    # on a CPU the mode compiles without graphs: the same values as the eager model
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-4, atol=1e-5)


GPU_RUN = [
    *TINY_MODEL, "train.device=cuda", "train.dtype=bf16", "train.seq_len=64", "train.global_batch_size=8",
    "train.micro_batch_size=4", "train.steps=6", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
    "scheduler.warmup_steps=2", "checkpoint.interval=0", "metrics.console=quiet", "parallel.compile=true",
]  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_graphs_follow_the_run_without_them(tmp_path):
    from forge.train.trainer import Trainer

    def losses(extra: list[str], name: str) -> dict:
        trainer = Trainer(compose([*GPU_RUN, *extra]), tmp_path / name)
        summary = trainer.fit()
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        whole = "parallel.compile_scope=model" in extra
        assert type(trainer.model).__name__.startswith("Compiled") == whole, type(trainer.model)
        return summary

    from torch._dynamo.utils import counters

    plain = losses([], "plain")
    for scope in ("blocks", "model"):
        counters["inductor"]["cudagraph_skips"] = 0
        graphs_before = counters["stats"]["unique_graphs"]
        graphs = losses(["parallel.cuda_graphs=true", f"parallel.compile_scope={scope}"], f"graphs_{scope}")
        assert counters["stats"]["unique_graphs"] > graphs_before, scope  # this run compiled graphs of its own
        assert counters["inductor"]["cudagraph_skips"] == 0, scope  # every graph was replayed, none fell back
        assert graphs["steps"] == plain["steps"] == 6
        # same seed and data; bf16 kernels may differ between a replayed and a launched graph only by rounding
        for key in ("first_val_loss", "final_val_loss", "final_loss"):
            assert graphs[key] == pytest.approx(plain[key], rel=2e-2), (scope, key)
