"""Random-access windows of a token array and a resumable, data-parallel batch loader."""

import numpy as np
import torch

from forge.data.documents import document_ids, mask_boundary_labels
from forge.data.order import EpochOrder
from forge.data.sources import DataError
from forge.models.common.attention import DocumentMask


def split_sample(samples: torch.Tensor, document_eos: int | None):
    """(inputs, labels) of stacked samples of seq_len + 1 tokens; with `document_eos`, (inputs, labels, doc_ids)
    where labels across a document boundary are -100."""
    inputs, labels = samples[:, :-1], samples[:, 1:]
    if document_eos is None:
        return inputs, labels
    return inputs, mask_boundary_labels(inputs, labels, document_eos), document_ids(inputs, document_eos)


class TokenWindows:
    """Non-overlapping samples of seq_len + 1 tokens (inputs and shifted labels) from a flat token array.

    With `vocab_size`, every sample read is checked to hold only ids below it (a max over a few thousand tokens),
    so a corrupted shard is named when it is read instead of failing as an index error inside the embedding.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int | None = None, source: str = "the tokens"):
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.source = source
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{len(tokens)} tokens hold no sample of seq_len={seq_len} + 1")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        sample = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if self.vocab_size is not None and (sample.max() >= self.vocab_size or sample.min() < 0):
            bad = int(sample.max()) if sample.max() >= self.vocab_size else int(sample.min())
            raise DataError(
                f"{self.source}: token id {bad} at tokens {start}..{start + self.seq_len} is outside the vocabulary "
                f"(data.vocab_size={self.vocab_size}): a corrupt shard? data.verify_checksums=true checks every shard"
            )
        return sample


class BatchLoader:
    """Shuffled batches, the same global order for any number of data-parallel ranks.

    Each call draws the next `micro_batch * dp_size` samples of a seeded per-epoch permutation; rank r takes
    its contiguous slice. An epoch ends only between optimizer steps of `global_batch` samples (default: one
    call's worth), skipping the tail that cannot fill one, so every layout (dp_size x micro_batch x gradient
    accumulation) of the same global batch sees the same samples at every step. The position (epoch, cursor) is
    the whole state, so resuming is exact, also with another dp_size or micro_batch. With `document_eos` (the EOS
    id) a batch also carries document ids and labels never cross a document (see forge.data.documents).
    """

    lr_scale = 1.0
    """Learning-rate factor asked by the data (mixture phases); always 1 here."""

    def __init__(
        self,
        windows: TokenWindows,
        micro_batch: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        document_eos: int | None = None,
        global_batch: int | None = None,
    ):
        self.global_batch = global_batch or micro_batch * dp_size
        if self.global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {self.global_batch} is not a multiple of {micro_batch} x {dp_size} ranks")
        if self.global_batch > len(windows):
            raise ValueError(f"{len(windows)} samples cannot fill one batch of {self.global_batch}")
        self.windows = windows
        self.micro_batch = micro_batch
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.document_eos = document_eos
        self.position = EpochOrder(len(windows), [seed])

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """(inputs, labels), each (micro_batch, seq_len) int64, plus doc_ids with document masking."""
        position = self.position
        if position.cursor % self.global_batch == 0 and position.cursor + self.global_batch > len(self.windows):
            position.next_epoch()  # only between optimizer steps: the tail that cannot fill one is skipped
        start = position.cursor + self.dp_rank * self.micro_batch
        indices = position.order[start : start + self.micro_batch]
        position.cursor += self.micro_batch * self.dp_size
        samples = torch.from_numpy(np.stack([self.windows[int(i)] for i in indices]))
        return split_sample(samples, self.document_eos)

    def metrics(self) -> dict:
        """Extra numbers for the training log (none for a single source)."""
        return {}

    def state_dict(self) -> dict:
        return {"epoch": self.position.epoch, "cursor": self.position.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']}, this run uses {self.seed}")
        self.position.seek(state["epoch"], state["cursor"])


def eval_batches(
    windows: TokenWindows,
    micro_batch: int,
    count: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    document_eos: int | None = None,
):
    """The first `count` validation micro-batches for this rank, in a fixed order (the same at every eval)."""
    per_rank = max(1, min(count, len(windows) // (micro_batch * dp_size)))
    for b in range(per_rank):
        start = (b * dp_size + dp_rank) * micro_batch
        samples = torch.from_numpy(np.stack([windows[i] for i in range(start, start + micro_batch)]))
        yield split_sample(samples, document_eos)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory without blocking: a plain copy from pageable
    memory makes the host wait until the GPU has finished all queued work (a host sync per micro-batch)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def batch_to_device(batch: tuple[torch.Tensor, ...], device: torch.device):
    """(inputs, labels, attn_mask or None) on `device`: with doc_ids, a DocumentMask, from which the model builds
    each layer's mask for its attention kernel (a dense one for SDPA, a BlockMask for flex)."""
    inputs, labels = to_device(batch[0], device), to_device(batch[1], device)
    attn_mask = DocumentMask(to_device(batch[2], device)) if len(batch) > 2 else None
    return inputs, labels, attn_mask
