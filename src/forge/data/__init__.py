"""Data: corpora, tokenizers and resumable loaders. Every corpus is a `Corpus` and makes a `Loader`: these two
protocols are all the trainer knows of the data."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch

Batch: TypeAlias = "tuple[torch.Tensor, ...] | dict[str, torch.Tensor]"
"""A micro-batch: (inputs, labels[, doc_ids]) of token data, or a dict of tensors (pixels, tokens, labels, ...)."""


class Loader(Protocol):
    """One data-parallel rank's training batches. The state is the whole position, so a resume is exact."""

    @property
    def lr_scale(self) -> float:
        """Factor on the next step's learning rate asked by the data (a mixture's phases); 1 elsewhere."""
        ...

    def next_batch(self) -> Batch:
        """This rank's next micro-batch."""
        ...

    def metrics(self) -> dict:
        """Numbers for the training log (tokens per source, data epoch, skipped media), possibly none."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Corpus(Protocol):
    """A data source: a loader of training batches for each rank, and fixed validation batches."""

    def make_loader(
        self, seq_len: int, micro_batch: int, global_batch: int, seed: int, dp_rank: int, dp_size: int
    ) -> Loader:
        """Rank `dp_rank`'s loader of micro-batches of `micro_batch` samples of `seq_len` tokens (text tokens for
        media), in a global order seeded by `seed`; an optimizer step takes `global_batch` samples over all ranks."""
        ...

    def val_batches(self, seq_len: int, micro_batch: int, count: int, dp_rank: int, dp_size: int) -> Iterator[Batch]:
        """At most `count` validation micro-batches of this rank, the same at every evaluation."""
        ...
