"""GPT-2 (forge.models.gpt2) against transformers' GPT2LMHeadModel, through the family's HF adapter both ways, and in
greedy decoding with its KV cache; its seeded initialisation; its tensor-parallel plan on 2 gloo ranks against one
process; its config rules."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from forge.checkpoint.errors import CheckpointError
from forge.config.degrees import Degrees
from forge.config.errors import ConfigError
from forge.generate.engine import generate
from forge.models.gpt2.args import GPT2Args
from forge.models.gpt2.hf import GPT2HF
from forge.models.gpt2.model import GPT2
from forge.models.gpt2.spec import SPEC, check
from tests.parallel.harness import launch

ADAPTER = GPT2HF()
VOCAB = 96
TINY = GPT2Args(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=64)
EPS = torch.finfo(torch.float32).eps
# fp32 on both sides, the same operations in another order (addmm vs matmul + add, fused vs composed tanh-GELU, a
# sharded reduction): sums of up to 256 products round differently, through 2 blocks; a few ulps of the largest
# value are seen, 64 leaves room for other CPUs' kernels
ULPS = 64


class FolderTensors:
    """An HF state dict as forge.checkpoint.hf.HFWeights presents a folder: names, and boxes of tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.files = dict.fromkeys(tensors, Path("model.safetensors"))

    def read(self, name: str, shape: tuple[int, ...], box: tuple[slice, ...]) -> torch.Tensor:
        assert tuple(self.tensors[name].shape) == shape, name
        return self.tensors[name][box]


def perturbed_(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter moved off its initial value (biases start at zero, LayerNorms at one: a name mapped to the
    wrong tensor would go unseen)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ULPS * EPS * scale)


def tokens(batch: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def transformers_and_ours(seed: int = 1) -> tuple[GPT2LMHeadModel, GPT2]:
    """A perturbed transformers GPT-2 and ours holding its weights, read through the family's adapter."""
    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    hf = perturbed_(GPT2LMHeadModel(config), seed).eval()
    folder = {name: value for name, value in hf.state_dict().items() if name != "lm_head.weight"}
    folder["transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64)  # the mask buffer of older exports: ignored
    args = ADAPTER.config_to_args(config.to_dict())
    ours = GPT2(args).eval()
    assert ADAPTER.our_keys(set(folder), args) == set(ours.state_dict())
    weights = FolderTensors(folder)
    state = {
        key: ADAPTER.read(key, tuple(value.shape), tuple(slice(0, n) for n in value.shape), weights, args)
        for key, value in ours.state_dict().items()
    }
    ours.load_state_dict(state)
    return hf, ours


def test_transformers_weights_give_transformers_logits():
    hf, ours = transformers_and_ours()
    x = tokens()
    with torch.no_grad():
        logits = ours(x)
        assert_logits_close(logits, hf(x).logits)
        torch.testing.assert_close(ours(x, head=False) @ ours.output.weight.T, logits)


def test_it_decodes_with_the_kv_cache_as_transformers_does():
    """forge-generate's engine through the family's cache: transformers' greedy tokens for each prompt, the same
    alone and left-padded in a batch, and the same as recomputing the whole sequence each step."""
    hf, ours = transformers_and_ours(seed=3)
    prompts = [tokens(1, 11, seed=4)[0].tolist(), tokens(1, 5, seed=5)[0].tolist()]
    new = 12
    batched = generate(ours, prompts, max_new_tokens=new)
    for prompt, got in zip(prompts, batched, strict=True):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
        assert got == theirs[0, len(prompt) :].tolist()
        assert generate(ours, [prompt], max_new_tokens=new) == [got]
        assert generate(ours, [prompt], max_new_tokens=new, use_cache=False) == [got]
    assert len(set(map(tuple, batched))) == 2  # the prompts lead apart: a cache that mixed them would show


def test_a_box_of_the_fused_projection_reads_its_columns_of_each_part():
    hf_weight = torch.randn(64, 3 * 64)
    weights = FolderTensors({"transformer.h.1.attn.c_attn.weight": hf_weight})
    box = (slice(8, 40), slice(1, 3), slice(16, 32))  # rows, the k and v parts, the second quarter of the heads
    got = ADAPTER.read("layers.1.attn.c_attn.weight", (64, 3, 64), box, weights, TINY)
    assert torch.equal(got, hf_weight.view(64, 3, 64)[box])


def test_bare_gpt2model_names_are_read():
    """openai-community/gpt2's own files name the tensors without `transformer.`."""
    hf_weight = torch.randn(VOCAB, 64)
    weights = FolderTensors({"wte.weight": hf_weight, "h.0.attn.masked_bias": torch.tensor(-1e4)})
    assert ADAPTER.our_keys(set(weights.files), TINY) == {"tok_embeddings.weight", "output.weight"}
    whole = (slice(0, VOCAB), slice(0, 64))
    assert torch.equal(ADAPTER.read("output.weight", (VOCAB, 64), whole, weights, TINY), hf_weight)


def test_export_loads_into_transformers_with_the_same_logits():
    ours = GPT2(TINY)
    ours.init_weights(seed=7)
    perturbed_(ours, 2).eval()
    config = ADAPTER.args_to_config(TINY)
    tensors = {}
    for key, value in ours.state_dict().items():
        entries = ADAPTER.entries(key, tuple(value.shape), TINY)
        for (name, shape), tensor in zip(entries, ADAPTER.to_hf(key, value, TINY), strict=True):
            assert tuple(tensor.shape) == shape
            tensors[name] = tensor
    hf = GPT2LMHeadModel(GPT2Config(**config)).eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # the tied head: the embedding
    assert hf.lm_head.weight is hf.transformer.wte.weight
    x = tokens(seed=1)
    with torch.no_grad():
        assert_logits_close(hf(x).logits, ours(x))
    assert ADAPTER.config_to_args(config) == TINY


def test_seeded_init_is_reproducible_and_covers_every_parameter():
    with torch.device("meta"):
        models = [GPT2(TINY), GPT2(TINY)]
    for model in models:
        model.to_empty(device="cpu")
        model.init_weights(seed=3)
    first, second = (dict(m.named_parameters()) for m in models)
    assert set(models[0].init_specs()) == set(first)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert models[0].output.weight is models[0].tok_embeddings.weight
    assert torch.equal(first["layers.0.attn.c_attn.bias"], torch.zeros(3, 64))
    assert torch.equal(first["layers.1.ln_2.weight"], torch.ones(64))
    # GPT-2's depth-scaled residual projections: std 0.02 / sqrt(2 * n_layers) = 0.01, against 0.02 elsewhere
    assert first["layers.0.mlp.c_proj.weight"].std().item() == pytest.approx(0.01, rel=0.1)
    assert first["layers.0.mlp.c_fc.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def run_tensor_parallel() -> dict:
    """Rank's loss and gradients (whole, gathered) with tp=2 against one process's on the same packed batch."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from forge.models.common.attention import DocumentMask
    from forge.parallel.init import materialize_sharded
    from forge.train.losses import CrossEntropyLoss, loss_context

    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork: a parallel region would hang
    x, labels = tokens(seq=16, seed=2), tokens(seq=16, seed=3)
    documents = DocumentMask(torch.tensor([[0] * 7 + [1] * 9, [0] * 16]))
    one = GPT2(TINY)
    one.init_weights(seed=11)
    want = CrossEntropyLoss()(one, x, labels, documents)
    want.backward()
    mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    with torch.device("meta"):
        model, plain = GPT2(TINY), GPT2(TINY)
    SPEC.tensor_parallel(model, mesh)
    materialize_sharded(model, plain, 11, "cpu")
    with loss_context(True):
        loss = CrossEntropyLoss()(model, x, labels, documents)
        loss.backward()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    reference = dict(one.named_parameters())
    out = {"loss": (loss.item(), want.item()), "weights": 0.0, "grads": {}, "placements": {}}
    for name, param in model.named_parameters():
        out["weights"] = max(out["weights"], (param.full_tensor() - reference[name]).abs().max().item())
        grad, want_grad = param.grad.full_tensor(), reference[name].grad
        out["grads"][name] = ((grad - want_grad).abs().max().item(), want_grad.abs().max().item())
        out["placements"][name] = str(param.placements[0])
    return out


@pytest.mark.dist
def test_tensor_parallel_matches_one_process():
    for rank in launch(run_tensor_parallel, 2, timeout=120):
        assert rank["weights"] == 0.0  # seeded init: the same values whatever the layout
        assert rank["loss"][0] == pytest.approx(rank["loss"][1], rel=1e-6)
        for name, (diff, scale) in rank["grads"].items():
            assert diff <= ULPS * EPS * scale, name  # the sharded reductions only reorder sums
        placements = rank["placements"]
        assert placements["layers.0.attn.c_attn.weight"] == "S(2)"
        assert placements["layers.0.attn.c_attn.bias"] == "S(1)"
        assert placements["layers.1.mlp.c_proj.weight"] == "S(0)"
        assert placements["tok_embeddings.weight"] == "S(0)"
        assert placements["pos_embeddings.weight"] == "R"


def config(**model) -> OmegaConf:
    fields = {"_target_": SPEC.target, "dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB} | model
    return OmegaConf.create({"model": fields, "parallel": {"fp8": False}})


def degrees(tp: int = 1) -> Degrees:
    return Degrees(dp_replicate=1, dp_shard=1, tp=tp, pp=1, ep=1)


@pytest.mark.parametrize(
    ("model", "tp", "refusal"),
    [
        ({"dim": 66}, 1, "model.dim=66 is not divisible by model.n_heads=4"),
        ({"n_heads": 2}, 4, "model.n_heads=2 must be divisible by parallel.tp=4"),
        ({"ffn_dim": 102}, 4, "hidden width 102 (model.ffn_dim, or 4 x model.dim) is not divisible by parallel.tp=4"),
        ({"attention": "flex"}, 1, "model.attention='flex' is not one of sdpa"),
        ({"n_kv_heads": 2}, 1, "unknown config key(s) model.n_kv_heads"),
    ],
)
def test_check_refuses(model, tp, refusal):
    with pytest.raises(ConfigError) as err:
        check(config(**model), degrees(tp))
    assert refusal in str(err.value)


def test_check_refuses_fp8_and_passes_a_tp_layout():
    cfg = config()
    check(cfg, degrees(tp=2))
    cfg.parallel.fp8 = True
    with pytest.raises(ConfigError, match="parallel.fp8=true is not supported with a GPT-2 model"):
        check(cfg, degrees())
    assert SPEC.parallel == {"tp", "cp"}  # pp and ep: refused by the generic validation


@pytest.mark.parametrize(
    ("setting", "refusal"),
    [
        ({"activation_function": "relu"}, "activation_function='relu' is not supported"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true is not supported"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=true is not supported"),
        ({"model_type": "llama"}, "model_type 'llama' is not a GPT-2 config"),
    ],
)
def test_configs_the_family_cannot_build_are_refused(setting, refusal):
    with pytest.raises(CheckpointError) as err:
        ADAPTER.config_to_args(ADAPTER.args_to_config(TINY) | setting)
    assert refusal in str(err.value)


def test_a_differing_config_names_the_field():
    theirs = ADAPTER.config_to_args(ADAPTER.args_to_config(TINY) | {"n_positions": 128})
    with pytest.raises(CheckpointError, match=r"config.json has n_positions=128 but model.max_seq_len=64"):
        ADAPTER.check_config(theirs, TINY, Path("config.json"))
    ADAPTER.check_config(ADAPTER.config_to_args(ADAPTER.args_to_config(TINY)), TINY, Path("config.json"))
