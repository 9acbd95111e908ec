"""EpochOrder: the permutation key is a contract with saved loader states, so it is pinned here."""

import numpy as np

from forge.data.loader import BatchLoader, TokenWindows
from forge.data.order import EpochOrder


def test_each_epoch_is_the_seeded_permutation_of_its_key():
    order = EpochOrder(10, [7, 3])
    seen = [order.next_index() for _ in range(25)]
    expected = [
        *np.random.default_rng([7, 3, 0]).permutation(10),
        *np.random.default_rng([7, 3, 1]).permutation(10),
        *np.random.default_rng([7, 3, 2]).permutation(10)[:5],
    ]
    assert seen == [int(i) for i in expected]
    assert (order.epoch, order.cursor) == (2, 5)


def test_seek_continues_where_a_saved_position_left_off():
    walked = EpochOrder(6, [1])
    for _ in range(8):
        walked.next_index()
    resumed = EpochOrder(6, [1])
    resumed.seek(walked.epoch, walked.cursor)
    assert [resumed.next_index() for _ in range(9)] == [walked.next_index() for _ in range(9)]


def test_batch_loader_resumes_a_state_written_before_epoch_order_existed():
    """Loader states are {"epoch", "cursor", "seed"} with the order drawn from [seed, epoch]: such a state resumes."""
    tokens = np.arange(20 * 8 + 1)
    windows = TokenWindows(tokens, 8)
    loader = BatchLoader(windows, micro_batch=2, seed=5)
    loader.load_state_dict({"epoch": 1, "cursor": 4, "seed": 5})
    inputs, _ = loader.next_batch()
    expected = np.random.default_rng([5, 1]).permutation(20)[4:6]
    assert [int(row[0]) // 8 for row in inputs] == [int(i) for i in expected]
