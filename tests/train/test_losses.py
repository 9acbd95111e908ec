"""conf/loss: z-loss equals its formula; the row-wise cross-entropy of plain logits gives torch's loss and
gradients; chunked cross-entropy gives the plain path's loss and gradients; both train the tiny model through the
Trainer."""

import json

import pytest
import torch

from forge.config import compose
from forge.models.llama.transformer import build_transformer
from forge.train import build, losses
from forge.train.losses import ChunkedCrossEntropyLoss, CrossEntropyLoss, rowwise_cross_entropy
from forge.train.trainer import Trainer
from tests.tiny import TINY_MODEL

TINY = [
    *TINY_MODEL,
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.dtype=fp32",
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "scheduler.warmup_steps=2",
    "metrics.console=quiet",
]


def test_z_loss_is_cross_entropy_plus_weighted_mean_squared_log_partition():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, 1] = labels[1, 4] = -100
    weight = 0.3
    loss = CrossEntropyLoss(z_loss_weight=weight)(lambda inputs, attn_mask=None: logits, None, labels)

    flat, ys = logits.reshape(-1, 11).double(), labels.reshape(-1)
    log_z = torch.log(torch.exp(flat).sum(dim=1))
    keep = ys != -100
    nll = (log_z - flat[torch.arange(len(ys)), ys.clamp(min=0)])[keep]
    expected = nll.mean() + weight * (log_z[keep] ** 2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert CrossEntropyLoss()(lambda inputs, attn_mask=None: logits, None, labels).item() == pytest.approx(
        nll.mean().item(), rel=1e-6
    )


def float64_loss_and_grad(logits, labels, z_loss_weight, scale):
    """Independent reference: torch's float64 cross-entropy (and z-loss) of the logits, and its gradient."""
    flat = logits.detach().double().flatten(0, 1).requires_grad_()
    ys = labels.flatten()
    keep = ys != -100
    loss = torch.nn.functional.cross_entropy(flat, ys, ignore_index=-100)
    loss = loss + z_loss_weight * (torch.logsumexp(flat, -1)[keep] ** 2).mean()
    (loss * scale).backward()
    return loss.detach(), flat.grad.view_as(logits)


@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
def test_rowwise_cross_entropy_is_torchs_in_loss_and_gradient_across_chunks(monkeypatch, z_loss_weight):
    # 3 rows per chunk over 2 x 10 tokens: an uneven last chunk, ignored labels inside and across chunks
    monkeypatch.setattr(losses, "CPU_CHUNK_BYTES", 4 * 3 * 50)
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(2, 10, 50, generator=gen)).requires_grad_()
    labels = torch.randint(0, 50, (2, 10), generator=gen)
    labels[0, 2:5] = labels[1, 9] = -100
    loss = rowwise_cross_entropy(logits, labels, z_loss_weight)
    (loss * 0.7).backward()
    expected, grad = float64_loss_and_grad(logits, labels, z_loss_weight, 0.7)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(logits.grad, grad.float(), rtol=1e-5, atol=1e-7)
    assert logits.grad[0, 2:5].abs().max() == 0 and logits.grad[1, 9].abs().max() == 0
    with torch.no_grad():
        assert rowwise_cross_entropy(logits, labels, z_loss_weight).item() == pytest.approx(loss.item(), rel=1e-6)


def test_rowwise_cross_entropy_of_bf16_logits_is_within_a_rounding_of_the_exact_gradient():
    """The gradient is rounded to bf16 once when made and once more when scaled in the backward. bf16 keeps 8
    significant bits, so each rounding is within 2^-8 of the value, and both within 2^-7 (with 1e-3 of that for
    the fp32 arithmetic before them). torch's own path rounds once: a scale off by 1 % would fail."""
    gen = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(4, 64, 1000, generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, 1000, (4, 64), generator=gen)
    labels[:, ::9] = -100
    loss = rowwise_cross_entropy(logits, labels)
    (loss * 0.3).backward()
    expected, grad = float64_loss_and_grad(logits, labels, 0.0, 0.3)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)  # the loss is an fp32 sum of fp32 rows
    assert logits.grad.dtype == torch.bfloat16
    error = (logits.grad.double() - grad).abs()
    assert (error <= 2**-7 * 1.001 * grad.abs()).all(), (error / grad.abs()).nan_to_num().max()


def test_rowwise_cross_entropy_refuses_a_second_backward_and_ignores_ignored_rows_whatever_they_hold():
    logits = torch.randn(1, 4, 7, requires_grad=True)
    loss = rowwise_cross_entropy(logits, torch.randint(0, 7, (1, 4)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # the gradient made in the forward was scaled in place by the first
    ignored = rowwise_cross_entropy(logits.detach().requires_grad_(), torch.full((1, 4), -100))
    assert ignored.item() == 0.0
    inf_row = logits.detach().clone()
    inf_row[0, 1] = float("inf")  # an ignored row's logits do not reach the loss, as in torch's
    labels = torch.tensor([[3, -100, 2, 5]])
    expected = torch.nn.functional.cross_entropy(inf_row[0], labels[0], ignore_index=-100)
    assert rowwise_cross_entropy(inf_row, labels).item() == pytest.approx(expected.item(), rel=1e-6)


def loss_and_grads(loss_fn, model, inputs, labels, dtype=torch.float32):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = loss_fn(model, inputs, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_cross_entropy_equals_plain_in_loss_and_gradients(z_loss_weight, tied):
    cfg = compose([*TINY, f"model.tie_embeddings={str(tied).lower()}"])
    model = build_transformer(build.model_args(cfg), seed=3)
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 8192, (3, 17), generator=gen)
    labels = torch.randint(0, 8192, (3, 17), generator=gen)
    labels[1, 5:9] = -100
    plain_loss, plain = loss_and_grads(CrossEntropyLoss(z_loss_weight), model, inputs, labels)
    chunked_loss, chunked = loss_and_grads(ChunkedCrossEntropyLoss(7, z_loss_weight), model, inputs, labels)
    assert chunked_loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    for name in plain:
        scale = plain[name].abs().max().item()  # fp32 summation order differs: errors ~1e-6 of the largest
        torch.testing.assert_close(chunked[name], plain[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_chunked_cross_entropy_under_bf16_autocast_stays_close_to_plain():
    model = build_transformer(build.model_args(compose(TINY)), seed=3)
    inputs = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(2))
    labels = inputs.roll(-1, dims=1)
    plain_loss, plain = loss_and_grads(CrossEntropyLoss(), model, inputs, labels, torch.bfloat16)
    chunked_loss, chunked = loss_and_grads(ChunkedCrossEntropyLoss(16), model, inputs, labels, torch.bfloat16)
    assert chunked_loss.item() == pytest.approx(plain_loss.item(), rel=1e-3)
    for name in ("output.weight", "tok_embeddings.weight", "layers.0.attention.wq.weight"):
        torch.testing.assert_close(chunked[name], plain[name], rtol=0.05, atol=2e-3 * plain[name].abs().max().item())


def test_chunked_loss_without_grad_is_the_same_number():
    model = build_transformer(build.model_args(compose(TINY)), seed=3)
    inputs = torch.randint(0, 8192, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = CrossEntropyLoss(0.1)(model, inputs, inputs)
        chunked = ChunkedCrossEntropyLoss(5, 0.1)(model, inputs, inputs)
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)


def train_losses(tmp_path, *overrides):
    Trainer(compose([*TINY, *overrides]), tmp_path).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_chunked_run_follows_the_plain_curve_and_z_loss_run_learns(tmp_path):
    plain = train_losses(tmp_path / "plain")
    chunked = train_losses(tmp_path / "chunked", "loss=chunked_cross_entropy", "loss.chunk_size=100")
    assert chunked == pytest.approx(plain, rel=1e-5)
    assert plain[-1] < plain[0] - 0.5
    z = train_losses(tmp_path / "z", "loss=z_loss", "loss.z_loss_weight=1e-3")
    assert z[-1] < z[0] - 0.5
    assert z[0] > plain[0]  # the same first batch, plus the z term (log Z ~ log 8192 at initialisation)


def test_parallel_compile_takes_the_cross_entropy_through_torch_compile_with_the_eager_values():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a graph another test compiled in this process would not count again
    cfg = compose(["parallel=single", "parallel.compile=true", "loss=z_loss", "loss.z_loss_weight=1e-2"])
    compiled, eager = build.build_loss(cfg), CrossEntropyLoss(z_loss_weight=1e-2)
    gen = torch.Generator().manual_seed(0)
    base = 4 * torch.randn(3, 7, 50, generator=gen)
    labels = torch.randint(0, 50, (3, 7), generator=gen)
    labels[0, :3] = -100
    results = []
    for loss_fn in (compiled, eager):
        before = counters["stats"]["unique_graphs"]
        logits = base.clone().requires_grad_()
        loss = loss_fn(lambda inputs, attn_mask=None, x=logits: x, None, labels)
        loss.backward()
        results.append((loss.detach(), logits.grad, counters["stats"]["unique_graphs"] - before))
    (loss_c, grad_c, graphs_c), (loss_e, grad_e, graphs_e) = results
    assert graphs_c >= 1 and graphs_e == 0  # only the compiled loss went through dynamo
    # one fp32 log-softmax of 50 values per token, summed in another order: a few ulp of the loss
    assert loss_c.item() == pytest.approx(loss_e.item(), rel=1e-6)
    torch.testing.assert_close(grad_c, grad_e, rtol=1e-5, atol=1e-7)
