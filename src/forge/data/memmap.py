"""Prepared token shards (from forge-prepare-data) as a corpus: memory-mapped, random access, train/val split."""

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from forge.data.shards import META, open_shards, read_meta
from forge.data.sources import DataError
from forge.data.token_corpus import TokenCorpus


class TokenSpan:
    """Tokens [start, stop) of several arrays laid end to end, sliced like one flat array (no copy until read)."""

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.arrays = arrays
        self.offsets = np.cumsum([0] + [len(a) for a in arrays])
        self.start = start
        self.stop = int(self.offsets[-1]) if stop is None else stop
        self.dtype = arrays[0].dtype if arrays else np.dtype(np.uint16)

    def __len__(self) -> int:
        return self.stop - self.start

    def span(self, start: int, stop: int) -> "TokenSpan":
        """The sub-span [start, stop) relative to this one."""
        return TokenSpan(self.arrays, self.start + start, self.start + stop)

    def pieces(self) -> list[np.ndarray]:
        """The span as views of the underlying arrays, in order (to lay several spans end to end)."""
        first = int(np.searchsorted(self.offsets, self.start, side="right")) - 1
        views, lo = [], self.start
        while lo < self.stop:
            begin = lo - int(self.offsets[first])
            take = min(self.stop, int(self.offsets[first + 1])) - lo
            views.append(self.arrays[first][begin : begin + take])
            lo += take
            first += 1
        return views

    def __getitem__(self, index: slice | int) -> np.ndarray:
        if isinstance(index, int | np.integer):
            return self[index : index + 1][0]
        lo, hi, step = index.indices(len(self))
        if step != 1:
            raise IndexError("TokenSpan supports contiguous slices only")
        lo, hi = self.start + lo, self.start + max(lo, hi)
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        parts = []
        while lo < hi:
            begin = lo - int(self.offsets[first])
            take = min(hi, int(self.offsets[first + 1])) - lo
            parts.append(self.arrays[first][begin : begin + take])
            lo += take
            first += 1
        if not parts:
            return np.empty(0, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class MemmapCorpus(TokenCorpus):
    """Train and validation tokens of a prepared output; the last `val_fraction` of its tokens is validation."""

    def __init__(
        self,
        path: str,
        vocab_size: int,
        val_fraction: float,
        document_masking: bool,
        verify_checksums: bool,
    ):
        folder = Path(path).expanduser()
        if not 0 < val_fraction < 1:
            raise DataError(f"data.val_fraction={val_fraction} must be in (0, 1)")
        self.meta = read_meta(folder)
        tokens = TokenSpan(open_shards(folder, self.meta, verify_checksums))
        if self.meta["vocab_size"] != vocab_size:
            recorded = self.meta["vocab_size"]
            raise DataError(f"data.vocab_size={vocab_size} but {folder} was tokenised with a vocabulary of {recorded}")
        n_val = max(1, round(len(tokens) * val_fraction))
        self.train_tokens = tokens.span(0, len(tokens) - n_val)
        self.val_tokens = tokens.span(len(tokens) - n_val, len(tokens))
        self.tokenizer = Tokenizer.from_file(str(folder / self.meta["tokenizer"]))
        self.vocab_size = vocab_size
        self.eos_id = self.meta.get("eos_id")
        if isinstance(self.eos_id, bool) or not isinstance(self.eos_id, int) or not 0 <= self.eos_id < vocab_size:
            # data.document_masking would find no document boundary and silently mask nothing
            raise DataError(
                f"{folder / META}: eos_id={self.eos_id!r} is not a token of the vocabulary (0..{vocab_size - 1})"
            )
        self.document_masking = document_masking
        self.folder = folder
        self.path, self.val_fraction = path, val_fraction
