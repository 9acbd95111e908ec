"""Packed samples with document boundaries: document ids, masked labels, and one attention mask function.

A sample is a window of the flat token stream, so it may hold several documents separated by EOS. The EOS token
belongs to the document it ends. `document_causal` is the single mask function: `dense_attention_mask` evaluates
it on a full (S, S) grid for SDPA (and CPU training), `flex_block_mask` hands it to FlexAttention.
"""

import torch

IGNORE_INDEX = -100


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, S) ids counting the EOS tokens strictly before each position: a document id local to the sample."""
    is_eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(is_eos, dim=-1) - is_eos


def mask_boundary_labels(inputs: torch.Tensor, labels: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Labels with IGNORE_INDEX where the input is an EOS (its label would be the next document's first token)."""
    return labels.masked_fill(inputs == eos_id, IGNORE_INDEX)


def document_causal(doc_ids: torch.Tensor):
    """The mask function (b, h, q, kv) -> bool: causal, and never across documents."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return mask_mod


def dense_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, S, S) mask for SDPA, True where attention is allowed, from `document_causal`."""
    batch, seq = doc_ids.shape
    b = torch.arange(batch, device=doc_ids.device).view(batch, 1, 1, 1)
    pos = torch.arange(seq, device=doc_ids.device)
    zero = torch.zeros((), dtype=torch.long, device=doc_ids.device)
    return document_causal(doc_ids)(b, zero, pos.view(1, 1, seq, 1), pos.view(1, 1, 1, seq))


def flex_block_mask(doc_ids: torch.Tensor, block_size: int = 128):
    """FlexAttention BlockMask of `document_causal` (for flex_attention on GPU, or compiled no-grad on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = doc_ids.shape
    return create_block_mask(
        document_causal(doc_ids), batch, None, seq, seq, device=str(doc_ids.device), BLOCK_SIZE=block_size
    )
