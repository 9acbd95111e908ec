"""The global gradient norm of plain (one-process) gradients: float64 squares, summed a chunk at a time on a CPU."""

import torch
from torch import nn

from forge.parallel import grads


def test_norm_summed_in_chunks_is_the_float64_norm_and_clips_as_torch(monkeypatch):
    monkeypatch.setattr(grads, "CPU_CHUNK_ELEMENTS", 1000)  # 3 chunks of the 50 x 50 weight, the last one short
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(50, 50), nn.Linear(50, 3))
    model(torch.randn(4, 50)).square().sum().backward()
    exact = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm()
    copies = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for copy, p in zip(copies, model.parameters(), strict=True):
        copy.grad = p.grad.clone()
    nn.utils.clip_grad_norm_(copies, 0.5)  # torch's own clipping, of copies
    norm = grads.clip_grad_norm(model, 0.5)
    assert norm.dtype == torch.float32
    assert abs(norm.double() - exact) <= 1e-7 * exact  # the float64 sum, rounded once to float32
    for p, copy in zip(model.parameters(), copies, strict=True):
        torch.testing.assert_close(p.grad, copy.grad, rtol=1e-6, atol=0)
