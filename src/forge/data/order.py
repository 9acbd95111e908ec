"""The sample order every loader walks: a seeded permutation per epoch and a position in it."""

import numpy as np


class EpochOrder:
    """A permutation of range(size) for each epoch, drawn from the seed key plus the epoch number, walked by a
    cursor. (epoch, cursor) is the whole state: the same key gives the same order in any process, so a resume, or
    a data-parallel rank reading its slice, needs nothing else."""

    def __init__(self, size: int, key: list[int]):
        self.size = size
        self.key = list(key)
        self.epoch = 0
        self.cursor = 0
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def order(self) -> np.ndarray:
        """This epoch's permutation (drawn once per epoch)."""
        if self._cached is None or self._cached[0] != self.epoch:
            permutation = np.random.default_rng([*self.key, self.epoch]).permutation(self.size)
            self._cached = (self.epoch, permutation)
        return self._cached[1]

    def next_epoch(self) -> None:
        self.epoch, self.cursor = self.epoch + 1, 0

    def next_index(self) -> int:
        """The next item, moving into the next epoch after the last one."""
        if self.cursor >= self.size:
            self.next_epoch()
        index = int(self.order[self.cursor])
        self.cursor += 1
        return index

    def seek(self, epoch: int, cursor: int) -> None:
        self.epoch, self.cursor = int(epoch), int(cursor)
