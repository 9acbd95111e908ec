"""model.attention=flex (a BlockMask) against the dense-mask SDPA path, with documents and sliding windows.

Tolerance, fp32: every output and gradient entry is a sum over at most S = 512 keys (or queries) of O(1) terms;
the two kernels add them in different orders, each addition rounding by up to u = 2^-24 of the running sum, so
they differ by about sqrt(S) * u * |sum| ~ 1.4e-6 for random inputs (the worst case, S * u, is 3e-5). The issue's
atol 1e-5 (with rtol 1e-5 for the larger gradient entries) sits between the two, while attending to one key more
or less moves outputs by ~1e-2, which each case checks against plain causal attention.

Shapes are those of the training run below (micro-batch 4, 512 tokens, 4 query and 2 kv heads of 16), so
create_block_mask and flex_attention compile once for the whole module (tens of seconds on a small CPU). On CPU
the gradients run flex's eager reference (torch 2.13 has no compiled CPU flex backward); the compiled block-sparse
kernel is checked without grad.
"""

import pytest
import torch

from forge.config import ConfigError, compose, validate
from forge.data.documents import document_ids
from forge.models.common.attention import DocumentMask, attend, flex_block_mask, layer_masks
from forge.models.common.kv_cache import KVCache
from forge.models.llama.transformer import Transformer, TransformerArgs
from forge.train.trainer import Trainer
from tests.tiny import TINY_MODEL, losses

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 4, 512, 4, 2, 16
EOS = 0
ATOL = RTOL = 1e-5
CASES = {  # name -> (packed documents, sliding window)
    "causal": (False, None),
    "documents": (True, None),
    "window": (False, 48),
    "documents+window": (True, 48),
}


def doc_ids_or_none(documents: bool) -> torch.Tensor | None:
    tokens = torch.randint(1, 40, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    tokens[tokens < 3] = EOS  # about one token in twenty ends a document
    return document_ids(tokens, EOS) if documents else None


def masks(documents: bool, window: int | None, flex: bool):
    ids = doc_ids_or_none(documents)
    mask = DocumentMask(ids) if ids is not None else None
    return layer_masks(mask, [window], flex, BATCH, SEQ, torch.device("cpu"))[window]


def qkv(requires_grad: bool) -> list[torch.Tensor]:
    """(batch, heads, seq, head_dim) views of (batch, seq, heads, head_dim), laid out as the model's are."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(BATCH, SEQ, HEADS, HEAD_DIM), (BATCH, SEQ, KV_HEADS, HEAD_DIM), (BATCH, SEQ, KV_HEADS, HEAD_DIM)]
    return [torch.randn(shape, generator=gen).requires_grad_(requires_grad) for shape in shapes]


def outputs_and_grads(mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = qkv(requires_grad=True)
    out = attend(*(t.transpose(1, 2) for t in leaves), mask)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    return out.detach(), list(torch.autograd.grad(out, leaves, cotangent))


@pytest.mark.parametrize("case", list(CASES))
def test_flex_outputs_and_gradients_equal_dense_sdpa(case):
    documents, window = CASES[case]
    dense_out, dense_grads = outputs_and_grads(masks(documents, window, flex=False))
    flex_out, flex_grads = outputs_and_grads(masks(documents, window, flex=True))
    torch.testing.assert_close(flex_out, dense_out, atol=ATOL, rtol=RTOL)
    for flex_grad, dense_grad in zip(flex_grads, dense_grads):
        torch.testing.assert_close(flex_grad, dense_grad, atol=ATOL, rtol=RTOL)
    with torch.no_grad():  # the compiled block-sparse kernel (forward only on CPU)
        compiled = attend(*(t.transpose(1, 2) for t in qkv(False)), masks(documents, window, flex=True))
        causal = attend(*(t.transpose(1, 2) for t in qkv(False)), None)
    torch.testing.assert_close(compiled, dense_out, atol=ATOL, rtol=RTOL)
    assert (case == "causal") == torch.allclose(dense_out, causal, atol=1e-3)


def test_block_mask_skips_the_blocks_out_of_reach():
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)  # 4 x 4 blocks of 128
    assert flex_block_mask(ids).sparsity() == pytest.approx(100 * 6 / 16)  # causal: above the diagonal
    assert flex_block_mask(ids, window=48).sparsity() == pytest.approx(100 * 9 / 16)  # the diagonal and the one below
    ids[:, 256:] = 1  # two documents of two blocks each: no block of the second sees the first
    assert flex_block_mask(ids).sparsity() == pytest.approx(100 * 10 / 16)


def test_a_windowed_layer_decodes_with_a_cache_as_it_reads_the_whole_sequence():
    torch.manual_seed(0)
    args = TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, sliding_window=[5, None])
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(1, 50, (2, 20))
    cache = KVCache()
    with torch.no_grad():
        whole = model(tokens)
        model(tokens[:, :12], cache=cache)
        steps = [model(tokens[:, i : i + 1], cache=cache) for i in range(12, 20)]
        unwindowed = Transformer(TransformerArgs(**{**args.__dict__, "sliding_window": None}))
        unwindowed.load_state_dict(model.state_dict())
        full = unwindowed(tokens)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole[:, 12:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(full[:, 12:], whole[:, 12:], atol=1e-3)


TRAIN = [
    *TINY_MODEL,
    "data.document_masking=true",
    "model.sliding_window=[96,null]",
    f"train.seq_len={SEQ}",
    f"train.global_batch_size={BATCH}",
    f"train.micro_batch_size={BATCH}",
    "train.dtype=fp32",
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "scheduler.warmup_steps=2",
]


def test_flex_training_follows_sdpa_training(tmp_path):
    """Documents packed in the embedded corpus, a sliding layer then a full one: same losses step by step."""
    runs = {}
    for kernel in ("sdpa", "flex"):
        summary = Trainer(compose([*TRAIN, f"model.attention={kernel}"]), tmp_path / kernel).fit()
        runs[kernel] = (losses(tmp_path / kernel), summary["final_val_loss"])
    (sdpa, sdpa_val), (flex, flex_val) = runs["sdpa"], runs["flex"]
    assert list(flex) == list(range(1, 5))
    assert list(flex.values()) == pytest.approx(list(sdpa.values()), rel=1e-5)
    assert flex_val == pytest.approx(sdpa_val, rel=1e-5)


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["model.attention=dense"], "model.attention='dense'"),
        (["model.sliding_window=0"], "model.sliding_window=0"),
        (["model.sliding_window=[64,0]"], "model.sliding_window=[64, 0]"),
        (["model.attention=flex", "parallel.compile=true", "train.device=cpu"], "parallel.compile=true"),
        (["vlm=joint_decoder", "data=vqa_embedded", "model.sliding_window=64"], "model.sliding_window"),
    ],
)
def test_validation_refuses_in_one_line_naming_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=1)
    assert keys in str(err.value) and "\n" not in str(err.value)


def test_block_masks_of_other_shapes_first_do_not_break_the_kernel():
    """A context-parallel part's mask, then the whole sequence's at another batch: the compiled create_block_mask
    recompiles per shape (static; with dynamic sizes inductor's CPU kernel failed to build in torch 2.13)."""
    from forge.models.common.attention import flex_block_mask
    from forge.parallel.context_parallel import chunk_positions, gathered_positions

    doc_ids = torch.arange(512).div(100, rounding_mode="floor")[None].expand(2, -1)
    flex_block_mask(doc_ids, 64, queries=chunk_positions(512, 2, 1), keys=gathered_positions(512, 2))
    documents, window = CASES["documents+window"]
    dense_out, _ = outputs_and_grads(masks(documents, window, flex=False))
    flex_out, _ = outputs_and_grads(masks(documents, window, flex=True))
    torch.testing.assert_close(flex_out, dense_out, atol=1e-5, rtol=1e-5)
