"""Packed samples with document boundaries: document ids and masked labels.

A sample is a window of the flat token stream, so it may hold several documents separated by EOS. The EOS token
belongs to the document it ends. The model turns the ids into its attention masks (forge.models.common.attention).
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
