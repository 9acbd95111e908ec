"""Random-access windows of a token array and a resumable, data-parallel batch loader."""

import numpy as np
import torch


class TokenWindows:
    """Non-overlapping samples of seq_len + 1 tokens (inputs and shifted labels) from a flat token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{len(tokens)} tokens hold no sample of seq_len={seq_len} + 1")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


class BatchLoader:
    """Shuffled batches, the same global order for any number of data-parallel ranks.

    Each call draws the next `micro_batch * dp_size` samples of a seeded per-epoch permutation; rank r takes
    its contiguous slice. The position (epoch, cursor) is the whole state, so resuming is exact, and a resume
    with a different dp_size continues the same global sample order.
    """

    def __init__(self, windows: TokenWindows, micro_batch: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if micro_batch * dp_size > len(windows):
            raise ValueError(f"{len(windows)} samples cannot fill one batch of {micro_batch} x {dp_size} ranks")
        self.windows = windows
        self.micro_batch = micro_batch
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (micro_batch, seq_len) int64."""
        span = self.micro_batch * self.dp_size
        if self.cursor + span > len(self.windows):
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        start = self.cursor + self.dp_rank * self.micro_batch
        indices = self._order[start : start + self.micro_batch]
        self.cursor += span
        samples = torch.from_numpy(np.stack([self.windows[int(i)] for i in indices]))
        return samples[:, :-1], samples[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']}, this run uses {self.seed}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)


def eval_batches(windows: TokenWindows, micro_batch: int, count: int, dp_rank: int = 0, dp_size: int = 1):
    """The first `count` validation micro-batches for this rank, in a fixed order (the same at every eval)."""
    per_rank = max(1, min(count, len(windows) // (micro_batch * dp_size)))
    for b in range(per_rank):
        start = (b * dp_size + dp_rank) * micro_batch
        samples = torch.from_numpy(np.stack([windows[i] for i in range(start, start + micro_batch)]))
        yield samples[:, :-1], samples[:, 1:]
