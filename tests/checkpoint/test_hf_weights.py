"""Hugging Face folders straight into a parallelized model, and a parallelized model out as one.

transformers' own LlamaForCausalLM / MixtralForCausalLM is the reference: logits of a fixed input agree at
atol 1e-4 (fp32). Each rank must read exactly the slices it holds: every `get_slice` read is recorded.
"""

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import forge
from forge.checkpoint import CheckpointError, hf_load
from forge.checkpoint.hf_load import load_hf_into
from forge.checkpoint.hf_save import save_run_hf
from forge.config import compose
from forge.models.llama import TransformerArgs
from forge.models.llama.args import MoEArgs
from forge.models.llama.transformer import build_transformer
from forge.parallel.init import plain_name
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY

VOCAB = 8192  # the embedded corpus's
GQA = [*TINY, "model.n_kv_heads=2"]
MOE = ["model=moe_tiny", *GQA, "model.moe.num_experts=4", "model.moe.expert_ffn_dim=32"]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SHAPE |= dict(rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False)
TINY_ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_dim=128)  # GQA as a model


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokens):
    """A sharded (index.json) Llama folder and its logits of `tokens`."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    model = LlamaForCausalLM(LlamaConfig(intermediate_size=128, **SHAPE)).eval()
    model.save_pretrained(folder, max_shard_size="1MB")
    assert (folder / hf_load.INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 1
    with torch.no_grad():
        return folder, model(tokens).logits


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, tokens):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mixtral")
    config = MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e4, **SHAPE)
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(folder)
    with torch.no_grad():
        return folder, model(tokens).logits


def local_numel(model) -> int:
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


def load_and_compare(overrides: list[str], root: str, folder: Path, tokens, want) -> dict:
    """On each rank: build the parallelized model, warm-start it from `folder`, compare its logits with `want`."""
    reads = []
    read = hf_load.HFWeights.read

    def recording(self, name, shape, box):
        out = read(self, name, shape, box)
        reads.append((name, out.numel(), torch.Size(shape).numel()))
        return out

    hf_load.HFWeights.read = recording  # this forked rank's copy of the module only
    trainer = Trainer(compose([*overrides, "checkpoint.resume=none"]), Path(root))
    trainer.checkpointer.load_weights(str(folder), trainer.model)
    warm = list(reads)  # the warm start's; the one-process reference below reads through HFWeights too
    held = local_numel(trainer.model)  # before any forward: FSDP leaves the root unsharded after one
    if trainer.pipeline is None:
        with torch.no_grad():
            logits = trainer.model.eval()(tokens)
        if isinstance(logits, DTensor):  # tensor parallelism leaves them split over the vocabulary
            logits = logits.full_tensor()
        diff = (logits - want).abs().max().item()
    else:  # a stage has no logits: its weights against the one-process loader's (itself checked against HF)
        reference = forge.load_pretrained(folder).state_dict()
        held_weights = [item for part in trainer.pipeline.parts for item in part.state_dict().items()]
        whole = [(key, value.full_tensor() if isinstance(value, DTensor) else value) for key, value in held_weights]
        diff = max((value - reference[plain_name(key)]).abs().max().item() for key, value in whole)
    return {
        "diff": diff,
        "read": sum(n for _, n, _ in warm),
        "held": held,
        "whole_reads": sorted(name for name, n, whole in warm if n == whole),
    }


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["fsdp", "tp2", "pp2"])
def test_sharded_llama_loads_into_each_layout_reading_only_its_shards(layout, llama, tokens, tmp_path):
    folder, want = llama
    ranks = launch(load_and_compare, 2, [*GQA, f"parallel={layout}"], str(tmp_path), folder, tokens, want)
    whole = load_hf_into(build_transformer(TransformerArgs(**TINY_ARGS)), folder)  # one process reads it all
    for rank in ranks:
        assert rank["diff"] < 1e-4
        assert rank["read"] == rank["held"]  # every element it holds, once, and nothing else
        assert 4 * rank["read"] < 0.6 * whole
    if layout == "fsdp":
        assert sum(r["read"] for r in ranks) * 4 == whole and not ranks[0]["whole_reads"]
    elif layout == "tp2":  # TP replicates only the norms
        assert all(name.endswith("norm.weight") for name in ranks[0]["whole_reads"])
    else:  # each stage reads its own blocks (and the embedding or the head and final norm) whole
        assert sum(r["read"] for r in ranks) * 4 == whole
        assert all(".layers.0." in n or "embed" in n for n in ranks[0]["whole_reads"])
        assert all(".layers.1." in n or n in ("lm_head.weight", "model.norm.weight") for n in ranks[1]["whole_reads"])


@pytest.mark.dist
def test_llama_loads_into_tp2_fsdp2(llama, tokens, tmp_path):
    folder, want = llama
    ranks = launch(load_and_compare, 4, [*GQA, "parallel=tp2_fsdp"], str(tmp_path), folder, tokens, want)
    for rank in ranks:  # 2-D placements (_StridedShard over dp, Shard over tp): still one box per rank
        assert rank["diff"] < 1e-4 and rank["read"] == rank["held"] and not rank["whole_reads"]


@pytest.mark.dist
def test_mixtral_loads_into_expert_parallel_fsdp(mixtral, tokens, tmp_path):
    folder, want = mixtral
    ranks = launch(load_and_compare, 2, [*MOE, "parallel=ep2_fsdp"], str(tmp_path), folder, tokens, want)
    for r, rank in enumerate(ranks):
        assert rank["diff"] < 1e-4 and rank["read"] == rank["held"]
        # Each rank owns two whole experts (FSDP shards everything else): it reads those experts' Linears whole.
        experts = {int(name.split(".")[5]) for name in rank["whole_reads"]}
        assert experts == {2 * r, 2 * r + 1} and all(".experts." in name for name in rank["whole_reads"])


MOE_LAYOUTS = {  # name -> (ranks, overrides): the experts split on their width, over ep and tp, in stages
    "tp2": (2, ["parallel=tp2"]),
    "tp2_ep2": (4, ["parallel=tp2_fsdp", "parallel.ep=2"]),
    "pp2_ep2": (4, ["parallel=pp2_fsdp", "parallel.ep=2", "model.n_layers=2"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_mixtral_loads_into_each_moe_layout_reading_only_its_shards(layout, mixtral, tokens, tmp_path):
    folder, want = mixtral
    nproc, overrides = MOE_LAYOUTS[layout]
    ranks = launch(load_and_compare, nproc, [*MOE, *overrides], str(tmp_path), folder, tokens, want)
    for rank in ranks:
        assert rank["diff"] < 1e-4 and rank["read"] == rank["held"]
        experts = {int(name.split(".")[5]) for name in rank["whole_reads"] if ".experts." in name}
        # under tp each rank reads part of every expert it holds; in the stages, 2 whole experts of its one block
        assert len(experts) == (2 if layout == "pp2_ep2" else 0)


def train_and_export(overrides: list[str], root: str) -> None:
    """A short run with a final checkpoint, then the call the trainer makes at its end."""
    trainer = Trainer(compose([*overrides, "checkpoint.save_final=true", "checkpoint.save_hf=true"]), Path(root))
    trainer.fit()
    save_run_hf(trainer.cfg.checkpoint, trainer.run_dir, trainer.model, trainer.corpus.tokenizer)


EXPORTS = {  # name -> (overrides, transformers class)
    "llama_fsdp": ([*GQA, "parallel=fsdp"], LlamaForCausalLM),
    "llama_tp2": ([*GQA, "parallel=tp2"], LlamaForCausalLM),
    "llama_pp2": ([*GQA, "parallel=pp2", "model.n_layers=4"], LlamaForCausalLM),  # stage 1 sends to rank 0
    # tied as Llama 3.2 1B: both stages hold the matrix, written once
    "llama_pp2_tied": ([*GQA, "parallel=pp2", "model.n_layers=4", "model.tie_embeddings=true"], LlamaForCausalLM),
    "mixtral_fsdp": ([*MOE, "parallel=fsdp"], MixtralForCausalLM),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(EXPORTS))
def test_a_run_saved_as_hf_loads_in_transformers(name, tokens, tmp_path):
    overrides, cls = EXPORTS[name]
    launch(train_and_export, 2, [*overrides, "train.steps=2"], str(tmp_path))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")]  # no staging folder left
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if not p.name.startswith("tokenizer")) == [
        "config.json",
        "model.safetensors",
    ]
    hf = cls.from_pretrained(tmp_path / "hf").eval()
    ours = forge.load_pretrained(tmp_path)  # the final DCP checkpoint of the same weights
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=0, atol=1e-4)
    assert (tmp_path / "hf/tokenizer.json").is_file()


def test_config_mismatch_names_the_first_differing_field(llama, tmp_path):
    folder, _ = llama
    model = build_transformer(TransformerArgs(**TINY_ARGS | {"n_layers": 3}))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=2 but model.n_layers=3"):
        load_hf_into(model, folder)
    moe = build_transformer(TransformerArgs(**TINY_ARGS, moe=MoEArgs(num_experts=4, expert_ffn_dim=32)))
    with pytest.raises(CheckpointError, match=r"model_type=llama but model.moe=set"):
        load_hf_into(moe, folder)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"broken/config.json"):
        load_hf_into(model, broken)


def test_excluded_keys_keep_their_values(llama, tokens):
    folder, _ = llama
    model = build_transformer(TransformerArgs(**TINY_ARGS))
    head = model.output.weight.detach().clone()
    load_hf_into(model, folder, exclude=("output.",))
    assert torch.equal(model.output.weight, head)
    hf = LlamaForCausalLM.from_pretrained(folder)
    assert torch.equal(model.tok_embeddings.weight, hf.model.embed_tokens.weight)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_safetensors_file_is_named(llama, tmp_path, damage):
    folder, _ = llama
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    victim = sorted(copy.glob("*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file at all")
    with pytest.raises(CheckpointError, match=victim.name):
        load_hf_into(build_transformer(TransformerArgs(**TINY_ARGS)), copy)
