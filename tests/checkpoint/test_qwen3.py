"""Qwen3 and Qwen3-MoE in and out, against transformers' own Qwen3ForCausalLM / Qwen3MoeForCausalLM.

Tolerance: both sides evaluate the same function in fp32 with other reduction orders and kernels (SDPA against
eager attention, nn.RMSNorm against HF's, per-expert loops against grouped GEMMs, RoPE tables rounded from fp64
against computed in fp32). On these models (weights ~N(0, 0.1), norms ~1 + N(0, 0.2), |logits| up to ~4) each
side's fp32 logits were measured against its own fp64 evaluation at 5-8 ulp of the largest logit (seeds 0-3,
2 x 64 tokens), and forge against transformers at 4-10 ulp. So the logits must agree to 64 ulp of the largest
logit (the sum of two such errors, 16 ulp, with 4x headroom): about 3e-5, under the issue's 1e-4. A wrong
mapping (q/k norms swapped, a transposed expert, head_dim mis-split) moves them by 1e-2 or more.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import forge
from forge.checkpoint import CheckpointError
from forge.checkpoint.cli import main as forge_convert
from forge.checkpoint.convert import save_as
from forge.checkpoint.hf_load import load_hf_into
from forge.checkpoint.hf_save import save_hf_from
from forge.config import compose
from forge.models.common.kv_cache import KVCache
from forge.models.llama import TransformerArgs
from forge.models.llama.args import MoEArgs
from forge.models.llama.hf_config import args_to_hf_config, hf_config_to_args
from forge.models.llama.transformer import build_transformer
from forge.planning.report import plan_report
from forge.train.trainer import Trainer
from tests.checkpoint.test_convert import TINY
from tests.tiny import losses

ULPS = 64
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
SHAPE |= dict(max_position_embeddings=128, rope_theta=1e6)  # head_dim 32, not 64 / 4
ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, vocab_size=300, qk_norm=True)
ARGS |= dict(norm_eps=1e-6, rope_theta=1e6, max_seq_len=128)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights away from their init (norms at 1 would hide swapped q/k norms, a 0.02 router near-uniform routing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model.eval()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol = ULPS * torch.finfo(torch.float32).eps * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


def logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    config = Qwen3Config(vocab_size=300, intermediate_size=96, tie_word_embeddings=True, **SHAPE)
    randomize(Qwen3ForCausalLM(config)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[1, 2], ids=["every_block_moe", "sparse_step_2"])
def qwen3_moe_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    config = Qwen3MoeConfig(
        vocab_size=300,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=request.param,
        **SHAPE,
    )
    randomize(Qwen3MoeForCausalLM(config)).save_pretrained(folder)
    return folder


def test_qwen3_folder_loads_with_matching_logits(qwen3_dir, tokens):
    model = forge.load_pretrained(qwen3_dir)
    args = model.args
    assert (args.head_dim, args.qk_norm, args.tie_embeddings, args.norm_eps) == (32, True, True, 1e-6)
    assert model.layers["0"].attention.wq.weight.shape == (4 * 32, 64)
    assert_logits_close(model(tokens).detach(), logits(Qwen3ForCausalLM.from_pretrained(qwen3_dir), tokens))


def test_qwen3_moe_folder_loads_with_matching_logits(qwen3_moe_dir, tokens):
    model = forge.load_pretrained(qwen3_moe_dir)
    moe = model.args.moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_dim, moe.router) == (4, 2, 48, "softmax_topk")
    assert model.layers["1"].feed_forward.experts.w1.shape == (4, 64, 48)
    want = logits(Qwen3MoeForCausalLM.from_pretrained(qwen3_moe_dir), tokens)
    assert_logits_close(model(tokens).detach(), want)


def test_qwen3_moe_to_dcp_to_hf_round_trip_is_bitwise(qwen3_moe_dir, tmp_path):
    assert forge_convert(["--to", "dcp", str(qwen3_moe_dir), str(tmp_path / "dcp")]) == 0
    assert forge_convert(["--to", "hf", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    config = json.loads((tmp_path / "back/config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["head_dim"] == 32
    with (
        safe_open(str(qwen3_moe_dir / "model.safetensors"), "pt") as original,
        safe_open(str(tmp_path / "back/model.safetensors"), "pt") as back,
    ):
        assert sorted(original.keys()) == sorted(back.keys())
        for key in original.keys():  # noqa: SIM118 - safe_open has no __iter__
            assert torch.equal(original.get_tensor(key), back.get_tensor(key)), key


@pytest.mark.parametrize("moe", [None, MoEArgs(num_experts=4, top_k=2, expert_ffn_dim=48)], ids=["dense", "moe"])
def test_a_qk_norm_model_exports_as_qwen3(moe, tmp_path, tokens):
    args = TransformerArgs(**ARGS, tie_embeddings=moe is None, moe=moe)
    model = randomize(build_transformer(args))
    save_as("hf", model.state_dict(), args, tmp_path / "hf")
    cls = Qwen3ForCausalLM if moe is None else Qwen3MoeForCausalLM
    assert json.loads((tmp_path / "hf/config.json").read_text())["architectures"] == [cls.__name__]
    assert_logits_close(logits(cls.from_pretrained(tmp_path / "hf"), tokens), logits(model, tokens))
    save_hf_from(model, tmp_path / "streamed")  # the writer of checkpoint.save_hf, one tensor at a time
    assert_logits_close(logits(cls.from_pretrained(tmp_path / "streamed"), tokens), logits(model, tokens))


def test_a_qwen3_moe_folder_warm_starts_a_built_model(qwen3_moe_dir, tokens):
    args = forge.load_pretrained(qwen3_moe_dir).args
    model = build_transformer(args)  # its own init, then the sliced reader of checkpoint.load_weights
    load_hf_into(model, qwen3_moe_dir)
    assert_logits_close(
        logits(model.eval(), tokens), logits(Qwen3MoeForCausalLM.from_pretrained(qwen3_moe_dir), tokens)
    )


@pytest.mark.parametrize(
    "option,value",
    [("router", "sigmoid_topk"), ("num_shared_experts", 1), ("capacity_factor", 1.25), ("first_dense", 1)],
)
def test_moe_settings_qwen3_moe_cannot_express_are_refused(tmp_path, option, value):
    args = TransformerArgs(**ARGS, moe=MoEArgs(num_experts=4, **{option: value}))
    with pytest.raises(CheckpointError, match=rf"model\.moe\.{option}={value} .*no Qwen3MoeForCausalLM equivalent"):
        save_as("hf", build_transformer(args).state_dict(), args, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
        ({"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] is not supported"),
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding_window=64 is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ],
)
def test_qwen3_moe_configs_forge_cannot_express_are_refused(change, message):
    args = TransformerArgs(**ARGS, moe=MoEArgs(num_experts=4, top_k=2, expert_ffn_dim=48))
    with pytest.raises(CheckpointError, match=message):
        hf_config_to_args(args_to_hf_config(args) | change)


def test_hf_config_round_trips_the_args():
    for args in (
        TransformerArgs(**ARGS),
        TransformerArgs(**ARGS, moe=MoEArgs(num_experts=4, top_k=2, expert_ffn_dim=48, every=2)),
    ):
        back = hf_config_to_args(args_to_hf_config(args))
        assert back.head_size == args.head_size and back.qk_norm and back.moe == args.moe


def test_head_dim_model_decodes_with_the_kv_cache_as_it_runs_whole(tokens):
    model = randomize(build_transformer(TransformerArgs(**ARGS)))
    whole = logits(model, tokens)
    cache, steps = KVCache(), []
    with torch.no_grad():
        steps.append(model(tokens[:, :20], cache=cache))
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(20, tokens.shape[1])]
    assert cache.layers[0][0].shape == (2, 2, tokens.shape[1], 32)
    assert_logits_close(torch.cat(steps, dim=1), whole)


def test_a_run_warm_started_from_qwen3_exports_what_transformers_loads(tmp_path):
    """A tiny Qwen3 (head_dim 32 on a 64-wide stream, q/k norms, tied) trains from a Hugging Face folder and its
    checkpoint.save_hf export is the run's final checkpoint to transformers."""
    source = tmp_path / "source"
    config = Qwen3Config(vocab_size=8192, intermediate_size=128, tie_word_embeddings=True, **SHAPE)
    hf_source = randomize(Qwen3ForCausalLM(config))
    hf_source.save_pretrained(source)
    qwen3 = ["model.head_dim=32", "model.qk_norm=true", "model.tie_embeddings=true", "model.norm_eps=1e-6"]
    qwen3 += ["model.rope_theta=1e6", f"checkpoint.load_weights={source}", "checkpoint.save_hf=true"]
    trainer = Trainer(compose([*TINY, *qwen3]), tmp_path / "run")
    torch.testing.assert_close(
        trainer.model.layers["1"].attention.k_norm.weight, hf_source.model.layers[1].self_attn.k_norm.weight
    )
    trainer.fit()
    curve = losses(tmp_path / "run")  # the scaled-down Qwen3 learns the embedded corpus
    assert curve[3] < curve[1]
    exported = Path(tmp_path / "run/hf")
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    ours = forge.load_pretrained(tmp_path / "run")  # the final checkpoint of the same weights
    assert not torch.equal(ours.layers["1"].attention.k_norm.weight, hf_source.model.layers[1].self_attn.k_norm.weight)
    batch = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(1))
    assert_logits_close(logits(Qwen3ForCausalLM.from_pretrained(exported), batch), logits(ours, batch))


@pytest.mark.parametrize(
    "preset,overrides,billions",
    [
        ("qwen3_0_6b", ["parallel=fsdp", "parallel.world_size=8"], (0.59, 0.61)),
        ("qwen3_8b", ["parallel=tp4_fsdp", "parallel.world_size=64"], (8.1, 8.3)),
        ("qwen3_30b_a3b", ["parallel=ep2_fsdp", "parallel.world_size=64", "parallel.ep=8"], (30.4, 30.6)),
    ],
)
def test_qwen3_presets_plan_at_their_published_sizes(preset, overrides, billions):
    text = plan_report(compose([f"model={preset}", *overrides]))
    low, high = billions
    total = float(text.split("model ")[1].split("B parameters")[0])
    assert low < total < high, text
    assert "estimated peak memory per rank" in text


def test_a_sliding_window_model_is_not_exported_as_full_attention(tmp_path):
    args = TransformerArgs(**ARGS, sliding_window=16)
    with pytest.raises(CheckpointError, match="model.sliding_window=16 has no Qwen3ForCausalLM equivalent"):
        save_as("hf", build_transformer(args).state_dict(), args, tmp_path / "hf")
