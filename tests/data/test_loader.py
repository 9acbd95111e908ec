import numpy as np
import pytest
import torch

from forge.data.loader import BatchLoader, TokenWindows, eval_batches


@pytest.fixture
def windows():
    return TokenWindows(np.arange(10_000, dtype=np.uint16), seq_len=16)


def test_windows_are_shifted_pairs(windows):
    loader = BatchLoader(windows, micro_batch=4, seed=0)
    inputs, labels = loader.next_batch()
    assert inputs.shape == labels.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert torch.all(labels - inputs == 1)


def test_same_seed_same_batches_other_seed_differs(windows):
    a, b, c = (BatchLoader(windows, 4, seed=s) for s in (1, 1, 2))
    for _ in range(5):
        xa, xb, xc = a.next_batch()[0], b.next_batch()[0], c.next_batch()[0]
        assert torch.equal(xa, xb)
    assert not torch.equal(xa, xc)


def test_resume_from_state_gives_the_same_batches(windows):
    loader = BatchLoader(windows, 8, seed=3)
    for _ in range(100):  # crosses an epoch boundary (624 samples / 8 per batch)
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch()[0] for _ in range(10)]
    resumed = BatchLoader(windows, 8, seed=3)
    resumed.load_state_dict(state)
    assert state["epoch"] == 1
    for batch in expected:
        assert torch.equal(resumed.next_batch()[0], batch)


def test_data_parallel_ranks_split_the_single_process_order(windows):
    single = BatchLoader(windows, 8, seed=5)
    ranks = [BatchLoader(windows, 4, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(20):
        whole = single.next_batch()[0]
        parts = torch.cat([r.next_batch()[0] for r in ranks])
        assert torch.equal(whole, parts)


def test_resume_with_another_dp_size_continues_the_global_order(windows):
    single = BatchLoader(windows, 8, seed=5)
    for _ in range(7):
        single.next_batch()
    ranks = [BatchLoader(windows, 4, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(single.state_dict())
    assert torch.equal(single.next_batch()[0], torch.cat([r.next_batch()[0] for r in ranks]))


def test_seed_mismatch_is_refused(windows):
    loader = BatchLoader(windows, 4, seed=1)
    with pytest.raises(ValueError, match="seed 1"):
        BatchLoader(windows, 4, seed=2).load_state_dict(loader.state_dict())


def test_eval_batches_are_fixed_and_disjoint_over_ranks(windows):
    first = [x for x, _ in eval_batches(windows, 4, 3)]
    again = [x for x, _ in eval_batches(windows, 4, 3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    r0 = torch.cat([x for x, _ in eval_batches(windows, 2, 3, dp_rank=0, dp_size=2)])
    r1 = torch.cat([x for x, _ in eval_batches(windows, 2, 3, dp_rank=1, dp_size=2)])
    assert not set(r0[:, 0].tolist()) & set(r1[:, 0].tolist())


@pytest.mark.parametrize("micro_batch,dp_size", [(2, 1), (2, 2), (1, 4)])
def test_every_layout_of_a_global_batch_sees_the_same_samples_across_epochs(micro_batch, dp_size):
    windows = TokenWindows(np.arange(30 * 16 + 1, dtype=np.uint16), seq_len=16)  # 30 samples: 3 steps + 6 left over
    whole = BatchLoader(windows, 8, seed=4, global_batch=8)
    ranks = [BatchLoader(windows, micro_batch, 4, r, dp_size, global_batch=8) for r in range(dp_size)]
    accumulation = 8 // (micro_batch * dp_size)
    for _ in range(8):  # crosses two epoch ends
        step = [rank.next_batch()[0] for _ in range(accumulation) for rank in ranks]
        assert torch.equal(torch.cat(step), whole.next_batch()[0])
    assert whole.epoch == ranks[0].epoch == 2
