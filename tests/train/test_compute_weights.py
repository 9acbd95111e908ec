"""bf16 compute weights (forge.train.compute_weights): a model held whole on its rank computes each step on one bf16
copy of its fp32 weights, which stay the master copy with fp32 gradients.

The reference is independent of the scope: a deep copy of the model converted to bf16 (`.to(torch.bfloat16)`), run
through the same loss; its bf16 gradients, summed in fp32, must be the scope's fp32 gradients bit for bit. bf16
matmuls run on any CPU (emulated without AVX512-BF16), so this runs everywhere.
"""

import copy
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from forge.config import compose
from forge.metrics.memory import peak_live_tensor_bytes
from forge.models.llama import TransformerArgs, build_transformer
from forge.train.compute_weights import SUM_PIECE, ComputeWeights, add_in_pieces
from forge.train.losses import CrossEntropyLoss
from forge.train.steps import TextStep
from forge.train.trainer import Trainer
from tests.tiny import TINY_MODEL

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, max_seq_len=32)
LOSS = CrossEntropyLoss()


def micro_batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, ARGS.vocab_size, (count, 2, 33), generator=torch.Generator().manual_seed(seed))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_of(model: torch.nn.Module, batch) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return LOSS(model, batch[0], batch[1], None)


def fp32_sums_of_bf16_gradients(model: torch.nn.Module, batches) -> dict[str, torch.Tensor]:
    """The reference: a bf16 copy of `model` (every parameter and buffer), each batch's gradient summed in fp32."""
    reference = copy.deepcopy(model).to(torch.bfloat16)
    expected: dict[str, torch.Tensor] = {}
    for batch in batches:
        reference.zero_grad(set_to_none=True)
        loss_of(reference, batch).backward()
        for name, p in reference.named_parameters():
            expected[name] = expected[name] + p.grad.float() if name in expected else p.grad.float()
    return expected


def test_gradients_are_the_fp32_sums_of_a_bf16_models_and_the_weights_stay_fp32():
    model = build_transformer(ARGS)
    batches = micro_batches(3)
    expected = fp32_sums_of_bf16_gradients(model, batches)
    masters = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}

    weights = ComputeWeights(model)
    with weights:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        for batch in batches:
            loss_of(model, batch).backward()
            assert all(p.grad is None for p in model.parameters())  # each bf16 gradient was taken at once

    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        ptr, value = masters[name]
        assert p.data_ptr() == ptr and torch.equal(p.detach(), value), name  # the very fp32 tensor, untouched
        assert torch.equal(p.grad, expected[name]), name
    # summed in bf16 instead, three micro-batches' gradients would differ from the fp32 sum
    assert any(not torch.equal(expected[n].bfloat16().float(), expected[n]) for n in expected)


def test_a_gradient_added_in_pieces_is_the_plain_sum_bit_for_bit():
    """Several pieces and a short last one: each element is the fp32 sum the cross-dtype add_ gives."""
    generator = torch.Generator().manual_seed(3)
    total = torch.randn(2 * SUM_PIECE + 1234, generator=generator).view(-1, 2)
    grad = torch.randn(total.shape, generator=generator).bfloat16()
    want = total.clone().add_(grad)
    add_in_pieces(total, grad, torch.empty(SUM_PIECE))
    assert torch.equal(total, want)


def test_fixed_copies_are_reused_step_after_step_and_stay_exact():
    """`fixed` (parallel.cuda_graphs): the same bf16 tensors every step, each holding that step's weights."""
    model = build_transformer(ARGS)
    weights = ComputeWeights(model, fixed=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    addresses = []
    for seed in (1, 2):
        batches = micro_batches(2, seed)
        expected = fp32_sums_of_bf16_gradients(model, batches)  # this step's weights, in bf16
        with weights:
            addresses.append([p.data_ptr() for p in model.parameters()])
            for batch in batches:
                loss_of(model, batch).backward()
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and torch.equal(p.grad, expected[name]), (seed, name)
        optimizer.step()  # the second step's copies must hold the updated weights
        optimizer.zero_grad(set_to_none=True)
    assert addresses[0] == addresses[1]  # the same copies, step after step
    assert all(c is None for c in ComputeWeights(model).copies)  # without `fixed` nothing is kept


def test_a_gradient_from_before_the_scope_keeps_adding_up_and_a_thawed_parameter_gets_one():
    model = build_transformer(ARGS)
    frozen = model.layers["0"].attention.wq.weight
    frozen.requires_grad_(False)
    weights = ComputeWeights(model)
    before, inside = micro_batches(2)
    with weights:
        loss_of(model, before).backward()
    assert frozen.grad is None
    first = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    frozen.requires_grad_(True)  # a freeze schedule thaws it between steps
    with weights:
        loss_of(model, inside).backward()
    assert frozen.grad is not None and frozen.grad.dtype == torch.float32
    for name, p in model.named_parameters():
        if name in first:  # grew by this step's gradient, in fp32
            assert p.grad.dtype == torch.float32 and not torch.equal(p.grad, first[name]), name

    with weights, pytest.raises(RuntimeError, match="do not nest"), weights:
        pass  # a nested scope would take the copies for the masters
    assert all(p.dtype == torch.float32 for p in model.parameters())

    model.zero_grad(set_to_none=True)
    loss_of(model, inside).backward()  # outside any scope: plain fp32 autocast training, gradients left in place
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def step_peak(compute_weights: bool) -> int:
    """Peak live tensor bytes of a 3-micro-batch bf16 TextStep, with the compute weights or autocast's casts."""
    model = build_transformer(ARGS)
    weights = ComputeWeights(model) if compute_weights else None
    step = TextStep(model, torch.device("cpu"), "bf16", compute_weights=weights)
    batches = micro_batches(3)
    step.forward_backward(batches, LOSS)  # the gradients exist before the measured step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.forward_backward(batches, LOSS)
    return peak_live_tensor_bytes(prof)


def test_the_copies_cost_what_autocasts_casts_cost_plus_those_of_the_weights_it_does_not_cast():
    model = build_transformer(ARGS)
    # autocast casts the linear layers' weights; the copies also hold the embedding and the norms in bf16, and each
    # backward's bf16 gradient lives beside its fp32 sum for a moment
    uncast = sum(p.numel() for name, p in model.named_parameters() if p.dim() < 2 or name == "tok_embeddings.weight")
    largest = max(p.numel() for p in model.parameters())
    assert step_peak(compute_weights=True) <= step_peak(compute_weights=False) + 2 * uncast + 2 * largest


BF16_RUN = [
    *TINY_MODEL, "train.dtype=bf16", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2",
    "train.steps=2", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.threads=1",
    "scheduler.warmup_steps=1", "metrics.console=quiet",
]  # fmt: skip


@pytest.mark.parametrize(("param_dtype", "copies"), [(None, True), ("bf16", True), ("fp32", False)])
def test_one_process_under_bf16_trains_on_the_copies_unless_param_dtype_is_fp32(tmp_path: Path, param_dtype, copies):
    extra = [] if param_dtype is None else [f"parallel.param_dtype={param_dtype}"]
    trainer = Trainer(compose([*BF16_RUN, *extra]), tmp_path)
    assert (trainer.step_body.compute_weights is not None) is copies
    summary = trainer.fit()
    assert summary["steps"] == 2 and summary["final_val_loss"] < summary["first_val_loss"]
    # between steps, and so in every checkpoint, the parameters are the fp32 masters
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
