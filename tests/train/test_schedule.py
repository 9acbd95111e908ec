import pytest
import torch

from forge.train import schedule


def lrs(factory, steps: int, **kwargs) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = factory(opt, **kwargs)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_warmup_rises_linearly_to_peak():
    values = lrs(schedule.warmup_constant, 12, warmup_steps=4)
    assert values[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert values[5:] == [1.0] * 7


def test_cosine_ends_at_min_ratio():
    values = lrs(schedule.warmup_cosine, 101, warmup_steps=10, total_steps=100, min_lr_ratio=0.1)
    assert max(values) == pytest.approx(1.0)
    assert values[55] == pytest.approx(0.55, abs=1e-6)
    assert values[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_linear_decay():
    values = lrs(schedule.warmup_linear, 101, warmup_steps=0, total_steps=100, min_lr_ratio=0.0)
    assert values[50] == pytest.approx(0.5)
    assert values[100] == pytest.approx(0.0)


def test_wsd_plateau_then_decay():
    values = lrs(
        schedule.warmup_stable_decay, 101, warmup_steps=10, total_steps=100, min_lr_ratio=0.0, decay_fraction=0.2
    )
    assert values[10:80] == [1.0] * 70
    assert values[90] == pytest.approx(0.5)
    assert values[100] == pytest.approx(0.0)
