"""Multi-head latent attention (model.attention_kind=mla) in and out, against transformers' DeepseekV3ForCausalLM.

Dense DeepSeek-V3 models (every block below first_k_dense_replace), with and without the query's low-rank pair,
and MoE ones (every block, one expert group, unscaled weights: forge's sigmoid_topk router with a shared expert).
Their folders interleave the rotary pairs (rope_interleave, transformers' default), which forge reorders on import;
exports say rope_interleave=false. Tolerance as tests/checkpoint/test_qwen3.py: 64 ulp of the largest logit.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, DeepseekV3Config, DeepseekV3ForCausalLM

import forge
from forge.checkpoint import CheckpointError
from forge.checkpoint.convert import save_as
from forge.checkpoint.hf_load import load_hf_into
from forge.checkpoint.hf_save import save_hf_from
from forge.config import compose
from forge.models.common.kv_cache import KVCache
from forge.models.llama import TransformerArgs
from forge.models.llama.args import MLAArgs, MoEArgs
from forge.models.llama.hf_config import args_to_hf_config, hf_config_to_args
from forge.models.llama.transformer import build_transformer
from forge.train.trainer import Trainer
from tests.checkpoint.test_qwen3 import assert_logits_close, logits, randomize
from tests.tiny import losses

MLA = dict(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
SHAPE |= dict(num_key_value_heads=4, first_k_dense_replace=2, max_position_embeddings=64, rope_theta=1e4, **MLA)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=[32, None], ids=["q_lora", "full_wq"])
def deepseek_dir(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("deepseek_v3")
    config = DeepseekV3Config(q_lora_rank=request.param, **SHAPE)
    assert config.rope_interleave  # the layout of DeepSeek's own checkpoints
    randomize(DeepseekV3ForCausalLM(config)).save_pretrained(folder)
    return folder


MOE = dict(first_k_dense_replace=0, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
MOE |= dict(n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0)


# DeepSeek-V3's own routing at small size: a leading dense block, 4 groups of 2 experts of which a token's best 2
# are candidates, weights scaled by 2.5 (the published model: 3 dense blocks, 8 groups of 32, best 4, 2.5)
GROUPED = {"first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}


@pytest.fixture(
    scope="module", params=[{}, {"first_k_dense_replace": 1}, GROUPED], ids=["all_moe", "first_dense", "grouped"]
)
def deepseek_moe_dir(request, tmp_path_factory) -> Path:
    """MoE in every block, after a leading dense block (first_k_dense_replace, 3 in DeepSeek-V3 itself), or with
    group-limited, scaled routing besides, with selection biases away from zero (they choose experts, and do not
    weigh them)."""
    folder = tmp_path_factory.mktemp("deepseek_v3_moe")
    config = DeepseekV3Config(q_lora_rank=32, **(SHAPE | MOE | request.param))
    model = randomize(DeepseekV3ForCausalLM(config))
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(folder)
    return folder


def test_a_deepseek_v3_moe_folder_loads_and_exports_with_matching_logits(deepseek_moe_dir, tokens, tmp_path):
    want = logits(DeepseekV3ForCausalLM.from_pretrained(deepseek_moe_dir), tokens)
    model = forge.load_pretrained(deepseek_moe_dir)
    moe = model.args.moe
    assert (moe.router, moe.num_experts, moe.top_k, moe.num_shared_experts) == ("sigmoid_topk", 8, 2, 1)
    dense = AutoConfig.from_pretrained(deepseek_moe_dir).first_k_dense_replace
    assert moe.first_dense == dense
    hf = AutoConfig.from_pretrained(deepseek_moe_dir)
    assert (moe.expert_groups, moe.groups_per_token, moe.route_scale) == (
        hf.n_group, hf.topk_group, hf.routed_scaling_factor)  # fmt: skip
    assert [hasattr(block.feed_forward, "router") for block in model.layers.values()] == [dense == 0, True]
    assert model.layers["1"].feed_forward.router.expert_bias.abs().sum() > 0
    assert_logits_close(model(tokens).detach(), want)
    sliced = build_transformer(model.args)
    load_hf_into(sliced, deepseek_moe_dir)
    assert_logits_close(logits(sliced.eval(), tokens), want)
    save_as("hf", model.state_dict(), model.args, tmp_path / "hf")
    assert_logits_close(logits(DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf"), tokens), want)


def test_a_deepseek_v3_folder_loads_with_matching_logits(deepseek_dir, tokens):
    model = forge.load_pretrained(deepseek_dir)
    assert model.args.attention_kind == "mla" and model.args.mla.kv_lora_rank == 24
    assert_logits_close(model(tokens).detach(), logits(DeepseekV3ForCausalLM.from_pretrained(deepseek_dir), tokens))


def test_the_sliced_reader_reorders_the_interleaved_rows(deepseek_dir, tokens):
    args = forge.load_pretrained(deepseek_dir).args
    model = build_transformer(args)  # its own init, then checkpoint.load_weights' reader
    load_hf_into(model, deepseek_dir)
    want = logits(DeepseekV3ForCausalLM.from_pretrained(deepseek_dir), tokens)
    assert_logits_close(logits(model.eval(), tokens), want)


def test_without_the_reordering_the_logits_differ(deepseek_dir, tokens, tmp_path):
    """The same weights read as rotate-half rows (config.json edited to rope_interleave=false): another model."""
    for file in deepseek_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"rope_interleave": False}))
    want = logits(DeepseekV3ForCausalLM.from_pretrained(deepseek_dir), tokens)
    assert (logits(forge.load_pretrained(tmp_path), tokens) - want).abs().max() > 1e-3


@pytest.mark.parametrize("q_lora_rank", [32, 0])
def test_an_mla_model_exports_as_deepseek_v3(q_lora_rank, tmp_path, tokens):
    args = TransformerArgs(dim=64, n_layers=2, n_heads=4, vocab_size=300, ffn_dim=96, max_seq_len=64,
                           attention_kind="mla", mla=MLAArgs(q_lora_rank=q_lora_rank, **MLA))  # fmt: skip
    model = randomize(build_transformer(args))
    save_as("hf", model.state_dict(), args, tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["rope_interleave"] is False
    assert_logits_close(logits(DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf"), tokens), logits(model, tokens))
    save_hf_from(model, tmp_path / "streamed")  # the writer of checkpoint.save_hf
    streamed = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "streamed")
    assert_logits_close(logits(streamed, tokens), logits(model, tokens))
    assert hf_config_to_args(config).mla == args.mla


def test_latent_attention_decodes_with_the_kv_cache_as_it_runs_whole(tokens):
    args = TransformerArgs(dim=64, n_layers=2, n_heads=4, vocab_size=300, ffn_dim=96, max_seq_len=64,
                           attention_kind="mla", mla=MLAArgs(q_lora_rank=32, **MLA))  # fmt: skip
    model = randomize(build_transformer(args))
    whole = logits(model, tokens)
    cache, steps = KVCache(), []
    with torch.no_grad():
        steps.append(model(tokens[:, :16], cache=cache))
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(16, tokens.shape[1])]
    assert cache.layers[0][0].shape == (2, 4, tokens.shape[1], 16 + 8)  # expanded keys: nope + rope per head
    assert_logits_close(torch.cat(steps, dim=1), whole)


def test_what_deepseek_v3_interop_does_not_cover_is_refused(tmp_path):
    moe = MoEArgs(num_experts=8, top_k=2, expert_ffn_dim=32, router="sigmoid_topk")
    config = args_to_hf_config(TransformerArgs(dim=64, n_heads=4, attention_kind="mla", mla=MLAArgs(**MLA), moe=moe))
    assert hf_config_to_args(config).moe == moe
    for change, message in [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 40.0}}, "rope_type 'yarn' is not supported"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            hf_config_to_args(config | change)
    softmax = TransformerArgs(dim=64, n_heads=4, attention_kind="mla", mla=MLAArgs(**MLA), moe=MoEArgs(num_experts=4))
    with pytest.raises(CheckpointError, match=r"model\.moe\.router=softmax_topk \(DeepSeek-V3 routes with sigmoid"):
        save_as("hf", build_transformer(softmax).state_dict(), softmax, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


SMALL_MLA = [
    "model=llama_tiny", "model.attention_kind=mla", "model.mla.q_lora_rank=64", "model.mla.kv_lora_rank=32",
    "model.mla.qk_nope_head_dim=32", "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=32",
]  # fmt: skip


def test_a_latent_attention_model_trains_on_the_embedded_corpus(tmp_path):
    run = [*SMALL_MLA, "train.steps=8", "train.log_every=1", "train.eval_every=0", "train.dtype=fp32",
           "train.seq_len=128", "train.eval_batches=1", "scheduler.warmup_steps=2",
           "metrics.console=quiet"]  # fmt: skip
    trainer = Trainer(compose(run), tmp_path / "run")
    assert type(trainer.model.layers["0"].attention).__name__ == "LatentAttention"
    trainer.fit()
    curve = losses(tmp_path / "run")
    assert curve[8] < curve[1] - 0.5
