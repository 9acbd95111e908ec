"""forge-convert and load_pretrained for MoE models against transformers' own MixtralForCausalLM.

Logits are compared at rtol = atol = 1e-4 (fp32; the two sides sum attention and experts in different orders).
forge-convert runs in this process (`forge.checkpoint.cli.main`); test_convert.py covers it as a subprocess.
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import MixtralConfig, MixtralForCausalLM

import forge
from forge.checkpoint import CheckpointError
from forge.checkpoint.cli import main as forge_convert
from forge.checkpoint.convert import save_as
from forge.config import compose
from forge.models.llama import TransformerArgs
from forge.models.llama.args import MoEArgs, RopeScalingArgs
from forge.models.llama.transformer import build_transformer
from forge.train.trainer import Trainer
from tests.checkpoint.test_convert import TINY

MOE_TINY = ["model=moe_tiny", *TINY, "model.moe.num_experts=4", "model.moe.expert_ffn_dim=48"]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("mixtral")
    MixtralForCausalLM(config).save_pretrained(folder)
    return folder


def mixtral_logits(folder, tokens):
    with torch.no_grad():
        return MixtralForCausalLM.from_pretrained(folder).eval()(tokens).logits


def test_mixtral_folder_loads_with_matching_logits(mixtral_dir):
    model = forge.load_pretrained(mixtral_dir)
    assert model.args.moe.num_experts == 4 and model.args.moe.top_k == 2
    assert model.layers["1"].feed_forward.experts.w1.shape == (4, 64, 48)
    tokens = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), mixtral_logits(mixtral_dir, tokens), rtol=1e-4, atol=1e-4)


def test_mixtral_to_dcp_to_mixtral_round_trip(mixtral_dir, tmp_path):
    assert forge_convert(["--to", "dcp", str(mixtral_dir), str(tmp_path / "dcp")]) == 0
    assert forge_convert(["--to", "hf", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back/config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    with (
        safe_open(str(mixtral_dir / "model.safetensors"), "pt") as original,
        safe_open(str(tmp_path / "back/model.safetensors"), "pt") as back,
    ):
        assert sorted(original.keys()) == sorted(back.keys())
        for key in original.keys():  # noqa: SIM118 - safe_open has no __iter__
            assert torch.equal(original.get_tensor(key), back.get_tensor(key)), key


def test_trained_moe_run_exports_to_mixtral(tmp_path):
    Trainer(compose(MOE_TINY), tmp_path / "run").fit()
    assert forge_convert(["--to", "hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    tokens = torch.randint(0, 8192, (2, 16))
    ours = forge.load_pretrained(tmp_path / "run")
    assert ours.args.moe is not None
    with torch.no_grad():
        torch.testing.assert_close(mixtral_logits(tmp_path / "hf", tokens), ours(tokens), rtol=1e-4, atol=1e-4)


def tiny_moe_args(**moe) -> TransformerArgs:
    return TransformerArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_dim=48, moe=MoEArgs(num_experts=4, **moe))


@pytest.mark.parametrize(
    "option,value",
    [("router", "sigmoid_topk"), ("num_shared_experts", 1), ("every", 2), ("capacity_factor", 1.25)],
)
def test_moe_settings_mixtral_cannot_express_are_refused(tmp_path, option, value):
    args = tiny_moe_args(**{option: value})
    state = build_transformer(args).state_dict()
    with pytest.raises(CheckpointError, match=rf"model\.moe\.{option}={value} .*no MixtralForCausalLM equivalent"):
        save_as("hf", state, args, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_cli_names_the_unsupported_moe_setting(tmp_path, capsys):
    args = tiny_moe_args(router="sigmoid_topk")
    save_as("torch", build_transformer(args).state_dict(), args, tmp_path / "moe.pt")
    assert forge_convert(["--to", "hf", str(tmp_path / "moe.pt"), str(tmp_path / "hf")]) == 1
    stderr = capsys.readouterr().err
    assert "model.moe.router=sigmoid_topk" in stderr and "MixtralForCausalLM" in stderr
    assert not (tmp_path / "hf").exists()


def test_llama3_rope_scaling_exports_to_mixtral(tmp_path):
    args = tiny_moe_args()
    args.max_seq_len, args.rope_scaling = 256, RopeScalingArgs(factor=8.0, original_max_seq_len=32)
    model = build_transformer(args).eval()
    save_as("hf", model.state_dict(), args, tmp_path / "hf")
    tokens = torch.randint(0, 64, (1, 200))  # positions far past original_max_seq_len, where the scaling matters
    with torch.no_grad():
        torch.testing.assert_close(mixtral_logits(tmp_path / "hf", tokens), model(tokens), rtol=1e-4, atol=1e-4)
