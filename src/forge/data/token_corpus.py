"""What the text corpora share: splits held as flat token arrays (documents end with EOS), cut into windows of
seq_len + 1 tokens, a BatchLoader over the training split and fixed validation batches."""

from collections.abc import Iterator

import numpy as np
import torch

from forge.data.loader import BatchLoader, TokenWindows, eval_batches
from forge.data.sources import DataError


def windows_of_split(
    tokens: np.ndarray,
    seq_len: int,
    vocab_size: int | None,
    split: str,
    path: str | None = None,
    val_fraction: float | None = None,
) -> TokenWindows:
    """The samples of one split, or a DataError naming the split, its size and what to change. `path` and
    `val_fraction` are the data options that name the split in messages (when the corpus has them)."""
    where = f" of data.path={path}" if path is not None else ""
    try:
        return TokenWindows(tokens, seq_len, vocab_size, f"the {split} split{where}")
    except ValueError as err:
        fraction = f" (data.val_fraction={val_fraction})" if val_fraction is not None else ""
        raise DataError(
            f"the {split} split{where}{fraction} is too short for train.seq_len={seq_len}: {err}; "
            "use a shorter train.seq_len"
            + (", a larger data.val_fraction" if fraction and split == "validation" else "")
            + " or more data"
        ) from err


class TokenCorpus:
    """A `Corpus` whose constructor sets the attributes below; a corpus with a loader of its own (a mixture, a
    Hugging Face stream) replaces `make_loader` and needs no `train_tokens`."""

    train_tokens: np.ndarray
    val_tokens: np.ndarray
    vocab_size: int
    """Every sample read is checked to hold only ids below it."""
    eos_id: int
    document_masking: bool
    """Batches carry document ids (from `eos_id`) and labels never cross a document."""
    path: str | None = None
    """data.path, named in the splits' errors."""
    val_fraction: float | None = None
    """data.val_fraction, named when a split is too short."""

    @property
    def document_eos(self) -> int | None:
        """The EOS id when document masking is on, else None."""
        return self.eos_id if self.document_masking else None

    def windows(self, tokens: np.ndarray, seq_len: int, split: str) -> TokenWindows:
        return windows_of_split(tokens, seq_len, self.vocab_size, split, self.path, self.val_fraction)

    def make_loader(
        self, seq_len: int, micro_batch: int, global_batch: int, seed: int, dp_rank: int, dp_size: int
    ) -> BatchLoader:
        windows = self.windows(self.train_tokens, seq_len, "training")
        return BatchLoader(windows, micro_batch, seed, dp_rank, dp_size, self.document_eos, global_batch=global_batch)

    def val_batches(
        self, seq_len: int, micro_batch: int, count: int, dp_rank: int, dp_size: int
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        windows = self.windows(self.val_tokens, seq_len, "validation")  # here, not at the first batch drawn
        return eval_batches(windows, micro_batch, count, dp_rank, dp_size, self.document_eos)
