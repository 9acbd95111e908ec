"""Context parallelism trains like one process: each sequence split over cp ranks (head and tail chunks), keys and
values gathered in every layer, with and without packed documents, alone, with FSDP, HSDP and TP, and with latent
attention.

The runs are the real Trainer on forked gloo ranks (tests/parallel/harness.py), fp32; the reference is the same
Trainer in one process on the same global batch.
"""

import json
from pathlib import Path

import pytest
import torch

from forge.data.embedded import read_scenes
from forge.models.common.attention import DocumentMask, dense_attention_mask
from forge.parallel.context_parallel import chunk_positions, gathered_positions
from tests.parallel.harness import launch
from tests.parallel.scenarios import run_scenarios

pytestmark = pytest.mark.dist

RTOL = 1e-4
WINDOW = "model.sliding_window=[12,null]"
MLA = ["model.attention_kind=mla", "model.mla.q_lora_rank=0", "model.mla.kv_lora_rank=24",
       "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12"]  # fmt: skip


def document_data(path: Path) -> list[str]:
    """Lines of the plays, one document each (~10 tokens): every 32-token sample packs several documents."""
    lines = [line for scene in read_scenes()[:40] for line in scene.splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return [
        "data=hf", f"data.dataset={path}", "data.vocab_size=50257", "model.vocab_size=50304", "data.shuffle=false",
        "data.document_masking=true", "data.val_documents=64",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[str]:
    return document_data(tmp_path_factory.mktemp("docs") / "lines.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, docs) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("cp")
    one = {
        "single": ["parallel=single", "train.micro_batch_size=8"],
        "single_docs": ["parallel=single", "train.micro_batch_size=8", *docs, WINDOW],
        "single_mla": ["parallel=single", "train.micro_batch_size=8", *MLA],
        "single_flex_docs": ["parallel=single", "train.micro_batch_size=8", "model.attention=flex", *docs, WINDOW],
    }
    two = {
        "cp2": ["parallel=cp2"],
        "cp2_docs": ["parallel=cp2", *docs, WINDOW],
        "cp2_mla": ["parallel=cp2", *MLA],  # latent attention gathers its expanded keys and values
        # the gather runs again when the block is recomputed in backward (selective keeps only matmul outputs;
        # full checkpointing recomputes the same way)
        "cp2_ac_selective": ["parallel=cp2", "parallel.activation_checkpoint=selective"],
        "cp2_flex_docs": ["parallel=cp2", "model.attention=flex", *docs, WINDOW],  # a BlockMask of the rank's part
    }
    four = {
        "cp2_fsdp": ["parallel=cp2_fsdp"],
        "cp2_fsdp_docs": ["parallel=cp2_fsdp", "train.micro_batch_size=2", *docs, WINDOW],
        "cp2_hsdp": ["parallel=cp2"],
        "cp2_tp2_docs": ["parallel=cp2", "parallel.tp=2", "parallel.dp_replicate=1", *docs, WINDOW],
    }
    return (
        launch(run_scenarios, 1, one, str(root / "one"))[0]
        | launch(run_scenarios, 2, two, str(root / "two"))[0]
        | launch(run_scenarios, 4, four, str(root / "four"))[0]
    )


LAYOUTS = {  # name: (reference, str() of the placements of a wq weight)
    "cp2": ("single", ["S(0)"]),
    "cp2_docs": ("single_docs", ["S(0)"]),
    "cp2_mla": ("single_mla", ["S(0)"]),
    "cp2_ac_selective": ("single", ["S(0)"]),
    "cp2_flex_docs": ("single_flex_docs", ["S(0)"]),
    "cp2_fsdp": ("single", ["S(0)"]),
    "cp2_fsdp_docs": ("single_docs", ["S(0)"]),
    "cp2_hsdp": ("single", ["R", "S(0)"]),
    "cp2_tp2_docs": ("single_docs", ["_S(0, 2)", "S(0)"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_one_process(layout, runs):
    reference, placements = LAYOUTS[layout]
    got, want = runs[layout], runs[reference]
    assert got["wq_placements"] == placements
    assert len(got["loss"]) == 4
    for key in ("loss", "grad_norm", "val_loss"):
        assert got[key] == pytest.approx(want[key], rel=RTOL), key


def test_documents_and_window_change_the_reference(runs):
    """The document runs would match the plain ones if the mask were lost on the way."""
    assert runs["single_docs"]["loss"][-1] != pytest.approx(runs["single"]["loss"][-1], rel=1e-2)
    assert runs["single_docs"]["loss"][-1] < runs["single_docs"]["loss"][0]


def test_chunks_balance_the_causal_work_and_cover_the_sequence():
    seq, cp = 32, 4
    parts = [chunk_positions(seq, cp, rank) for rank in range(cp)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq))
    assert torch.equal(parts[0], torch.tensor([0, 1, 2, 3, 28, 29, 30, 31]))
    # keys each rank's queries see under the causal mask: the same for every rank
    assert len({int((part + 1).sum()) for part in parts}) == 1
    assert torch.equal(gathered_positions(seq, cp), torch.cat(parts))


def test_a_parts_block_mask_allows_what_its_dense_mask_allows():
    from forge.models.common.attention import flex_block_mask

    doc_ids = torch.arange(512).div(100, rounding_mode="floor")[None].expand(2, -1)
    queries, keys = chunk_positions(512, 2, 1), gathered_positions(512, 2)
    block = flex_block_mask(doc_ids, 64, block_size=128, queries=queries, keys=keys)
    dense = dense_attention_mask(doc_ids, 64, queries, keys)
    assert torch.equal(block.to_dense().bool(), block_any(dense, 128))
    assert block.sparsity() > 40  # the chunks are contiguous: most key blocks of a query block are skipped


def block_any(mask: torch.Tensor, size: int) -> torch.Tensor:
    """(B, 1, Q / size, K / size): True where any element of a (size x size) block is allowed."""
    b, h, q, k = mask.shape
    return mask.view(b, h, q // size, size, k // size, size).any(dim=(3, 5))


def test_a_part_of_the_sequence_gets_its_rows_of_the_whole_mask():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
    whole = dense_attention_mask(doc_ids, window=3)
    queries, keys = chunk_positions(12, 2, 1), gathered_positions(12, 2)
    part = dense_attention_mask(DocumentMask(doc_ids, queries, keys).doc_ids, 3, queries, keys)
    assert torch.equal(part, whole[:, :, queries][:, :, :, keys])


REFUSED = {  # overrides on 4 ranks -> what the one line names
    "seq": (["parallel=cp2", "train.seq_len=30"], "train.seq_len=30 is not divisible by 2 x parallel.cp=2"),
    "capacity": (
        ["parallel=cp2", "model=moe_tiny", "model.moe.capacity_factor=1.0"],
        "parallel.cp=2 with model.moe.capacity_factor > 0",
    ),
    "vlm": (["parallel=cp2", "vlm=joint_decoder", "data=vqa_embedded"], "parallel.cp=2 is not supported with a VLM"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_validation_refuses_what_context_parallelism_does_not_cover(case):
    from forge.config import ConfigError, compose, validate

    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match="^" + message.replace("+", r"\+").replace(".", r"\.")):
        validate(compose(overrides), world_size=4)


def test_presets_fill_any_even_world():
    from forge.config import compose, validate

    for world in (2, 4, 8):
        cp2, cp2_fsdp = (validate(compose([f"parallel={name}"]), world_size=world) for name in ("cp2", "cp2_fsdp"))
        assert (cp2.cp, cp2.dp_replicate, cp2.dp_shard) == (2, world // 2, 1)
        assert (cp2_fsdp.cp, cp2_fsdp.dp_shard, cp2_fsdp.fsdp_shard) == (2, world // 2, world)


def test_expanded_kv_heads_attend_as_grouped_ones():
    """The masked CUDA path repeats the kv heads (forge.models.common.attention.attend): the same attention as SDPA's
    own grouping, checked here on the CPU under a context-parallel part's mask."""
    import torch.nn.functional as F

    from forge.models.common.attention import expand_kv_heads

    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 6, 16, generator=gen), *torch.randn(2, 2, 2, 12, 16, generator=gen)
    mask = dense_attention_mask(torch.zeros(1, 12, dtype=torch.long), None, chunk_positions(12, 2, 1),
                                gathered_positions(12, 2))  # fmt: skip
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    expanded = F.scaled_dot_product_attention(q, expand_kv_heads(k, 8), expand_kv_heads(v, 8), attn_mask=mask)
    torch.testing.assert_close(expanded, grouped)
