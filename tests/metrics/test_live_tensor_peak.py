"""The peak of live tensor bytes the search's memory checks compare against: followed by address, so a free the
profiler never sees (made on a thread it does not follow) does not leave its tensor counted live."""

import torch
from torch.profiler import ProfilerActivity, profile

from forge.metrics.memory import peak_live_tensor_bytes, peak_of_allocations


def test_an_address_allocated_again_retires_the_tensor_that_held_it():
    # address 1 is freed unseen, then allocated again: 100 + 50 live at most, not 100 + 50 + 80
    assert peak_of_allocations([(1, 100), (2, 50), (1, 80)]) == 150
    assert peak_of_allocations([(1, 100), (1, -100), (2, 50)]) == 100
    # a free of a tensor from before the window subtracts nothing it did not add
    assert peak_of_allocations([(9, -40), (1, 100)]) == 100


def test_a_real_profile_counts_the_tensors_live_together():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.ones(1000)  # 4,000 bytes
        b = torch.ones(500)  # 2,000
        del a
        c = torch.ones(250)  # 1,000
        del b, c
    assert peak_live_tensor_bytes(prof) == 6000
