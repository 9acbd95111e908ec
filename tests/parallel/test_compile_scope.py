"""parallel.compile_scope: the blocks compiled apart, or the whole forward as one graph (forge.parallel.plan).

Here: the refusals (one line, exit 2), and that `model` puts the head inside the compiled graph with the eager
model's values and gradients (also around checkpointed blocks, and an MoE's graph breaks), sums the embedding's
gradient in the same order every run, keeps the checkpoint keys and every model of a class compiled, and that a
deepcopy runs its own weights.
The trainer's run with it against an eager one: tests/parallel/test_parity.py (compile tests); with CUDA graphs:
tests/parallel/test_cuda_graphs.py.
"""

import copy
import subprocess
from dataclasses import replace

import pytest
import torch

from forge.config import ConfigError, compose, validate
from forge.models.llama import TransformerArgs, build_transformer
from forge.models.llama.args import MoEArgs
from forge.parallel.plan import apply_activation_checkpointing, apply_compile
from tests.conftest import ROOT, forge_cmd, one_line

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, max_seq_len=32)
WHOLE = ["parallel.compile=true", "parallel.compile_scope=model"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's compiles from scratch: dynamo keeps at most 8 entries per code object (Transformer.forward's,
    shared by every model this process compiles) and runs past them eagerly, without failing."""
    torch._dynamo.reset()


def test_the_scope_needs_compile():
    with pytest.raises(ConfigError, match="parallel.compile_scope=model needs parallel.compile=true"):
        validate(compose(["parallel.compile_scope=model"]), world_size=1)


def test_one_process_only():
    validate(compose(WHOLE), world_size=1)
    with pytest.raises(ConfigError, match="compile_scope=model with a world of 2 processes .* is not supported"):
        validate(compose([*WHOLE, "parallel=fsdp"]), world_size=2)


@pytest.mark.parametrize("override", ["parallel.fp8=true", "model.attention=flex"])
def test_the_paths_not_run_are_refused(override):
    with pytest.raises(ConfigError, match=f"compile_scope=model with {override} is not supported"):
        validate(compose([*WHOLE, override, "train.device=cuda"]), world_size=1)


def test_the_command_line_refuses_in_one_line(tmp_path):
    cmd = forge_cmd(*WHOLE, "parallel.world_size=4", f"hydra.run.dir={tmp_path}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "parallel.compile_scope=model with a world of 4 processes" in one_line(proc)


VARIANTS = {  # name -> (scope, model arguments, activation checkpointing)
    "blocks": ("blocks", ARGS, None),
    "model": ("model", ARGS, None),
    "model, checkpointed blocks": ("model", ARGS, "full"),
    "model, MoE (graph breaks at the dispatch)": ("model", replace(ARGS, moe=MoEArgs(num_experts=4)), None),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_scope_decides_what_runs_compiled(name):
    """Hooks on the final norm and the head record whether they run inside a compiled graph: only `model` puts
    them there. Values and gradients are the eager model's (fp32: inductor reorders sums, ~1e-6 relative)."""
    scope, args, checkpointing = VARIANTS[name]
    model = build_transformer(args)
    reference = copy.deepcopy(model)
    if checkpointing:
        apply_activation_checkpointing(model, checkpointing)
    compiled = []
    for part in ("norm", "output"):
        getattr(model, part).register_forward_hook(lambda *_: compiled.append(torch.compiler.is_compiling()))
    applied = apply_compile(model, scope=scope)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    out.float().square().mean().backward()
    assert compiled == [scope == "model"] * 2, compiled
    assert ("as one graph" in applied.detail) == (scope == "model")
    expected = reference(tokens)
    expected.float().square().mean().backward()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for (key, param), twin in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, twin.grad, rtol=1e-4, atol=1e-6, msg=key)


def test_models_of_one_class_share_the_compiled_code():
    """Dynamo guards on the type of the compiled forward's `self`: one subclass per model class keeps every model
    compiled past torch's recompile limit (8 cache entries per code object), where a class per model fell back
    to eager from the fifth model (a training and an evaluation graph each)."""
    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):
        model = build_transformer(ARGS)
        compiled = []
        model.output.register_forward_hook(lambda *_, seen=compiled: seen.append(torch.compiler.is_compiling()))
        apply_compile(model, scope="model")
        tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
        model(tokens).sum().backward()
        with torch.no_grad():
            model(tokens)
        assert compiled == [True, True]


def test_the_whole_model_keeps_its_checkpoint_keys_and_a_copy_runs_its_own_weights():
    model = build_transformer(ARGS)
    reference = copy.deepcopy(model)
    apply_compile(model, scope="model")
    assert list(model.state_dict()) == list(reference.state_dict())
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.output.weight.mul_(2)
        reference.output.weight.mul_(2)
        torch.testing.assert_close(twin(tokens), reference(tokens), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(model(tokens), twin(tokens))


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="atomic adds need 2 threads to race")
def test_the_embedding_gradient_is_the_same_every_run():
    """Inductor's embedding backward adds repeated tokens' rows with atomic adds (an order of its threads' making:
    it differed between runs at this size, 2 threads); the embedding kept eager sums them in one order."""
    args = TransformerArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=512, max_seq_len=256)
    model = build_transformer(args)
    apply_compile(model, scope="model")
    tokens = torch.randint(0, args.vocab_size, (8, 256), generator=torch.Generator().manual_seed(0))
    grads = []
    for _ in range(4):
        model.zero_grad()
        model(tokens).float().square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for later in grads[1:]:
        for name, grad in grads[0].items():
            assert torch.equal(grad, later[name]), name
