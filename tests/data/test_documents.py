"""Document masking: ids, masked labels, one mask function for SDPA (dense) and FlexAttention (block mask)."""

import torch

from forge.data.documents import document_ids, mask_boundary_labels
from forge.data.loader import BatchLoader, TokenWindows
from forge.models.common.attention import dense_attention_mask
from forge.models.llama import Transformer, TransformerArgs

EOS = 0


def test_ids_and_labels_at_boundaries():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3]]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    assert mask_boundary_labels(inputs, labels, EOS).tolist() == [[6, EOS, -100, EOS, -100, -100]]


def test_dense_mask_is_causal_within_documents_only():
    mask = dense_attention_mask(torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]]))
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(mask[0, 0], expected.bool())
    assert mask[1, 0, 2, 1] and not mask[1, 0, 3, 2] and mask[1, 0, 4, 3]


def test_loader_batches_carry_document_ids_and_masked_labels():
    stream = torch.tensor([3, 4, EOS, 5, 6, 7, EOS, 8, 9, EOS] * 50).numpy()
    loader = BatchLoader(TokenWindows(stream, 16), 4, seed=0, document_eos=EOS)
    inputs, labels, doc_ids = loader.next_batch()
    assert doc_ids.shape == inputs.shape
    assert torch.all(labels[inputs == EOS] == -100) and torch.all(labels[inputs != EOS] != -100)
    assert torch.equal(doc_ids, document_ids(inputs, EOS))


def test_packed_document_sees_exactly_what_it_sees_alone():
    """With the mask, a document's logits inside a packed sample equal its logits alone (RoPE is relative)."""
    torch.manual_seed(0)
    model = Transformer(TransformerArgs(dim=64, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=64))
    model.init_weights()
    first, second = torch.randint(1, 50, (1, 9)), torch.randint(1, 50, (1, 12))
    packed = torch.cat([first, torch.tensor([[EOS]]), second], dim=1)
    mask = dense_attention_mask(document_ids(packed, EOS))
    with torch.no_grad():
        alone = model(second)
        together = model(packed, attn_mask=mask)[:, 10:]
        unmasked = model(packed)[:, 10:]
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(unmasked, alone, atol=1e-3)
