"""Global-batch load balancing on 2 real gloo ranks: the aux loss equals one process's over the whole batch."""

import copy

import pytest
import torch
import torch.distributed as dist

from forge.models.common.moe import MoE
from forge.models.llama import MoEArgs
from forge.parallel.expert import sum_load_over
from tests.parallel.harness import launch

pytestmark = pytest.mark.dist

WORLD, DIM, HIDDEN = 2, 16, 32


def make_layer(scope: str) -> MoE:
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, MoEArgs(num_experts=4, top_k=2, aux_loss_scope=scope))
    layer.init_weights(0.5, 0.5)
    return layer


def aux_and_gate_grad(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.zero_grad()
    layer(x)
    layer.last_aux_loss.backward()
    return layer.last_aux_loss.detach(), layer.router.gate.weight.grad.clone()


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    total = value.clone()
    dist.all_reduce(total)
    return total / WORLD


def rank_aux_against_whole_batch() -> dict:
    """Each rank routes its half of one batch; one process (the same layer, unsplit) routes the whole of it."""
    torch.set_num_threads(1)  # a forked child cannot use the parent's OpenMP pool: a parallel region would hang
    rank = dist.get_rank()
    whole = torch.randn(WORLD * 3, 5, DIM, generator=torch.Generator().manual_seed(1))
    half = whole.chunk(WORLD)[rank]
    out = {}
    for scope in ("global_batch", "micro_batch"):
        layer = make_layer(scope)
        want_aux, want_grad = aux_and_gate_grad(copy.deepcopy(layer), whole)
        assert sum_load_over(dist.group.WORLD, layer) == (1 if scope == "global_batch" else 0)
        aux, grad = aux_and_gate_grad(layer, half)
        # Data parallelism averages the ranks' gradients; the logged loss is the ranks' mean.
        out[scope] = {
            "aux": mean_over_ranks(aux).item(),
            "want_aux": want_aux.item(),
            "grad_err": (mean_over_ranks(grad) - want_grad).abs().max().item(),
            "grad_scale": want_grad.abs().max().item(),
        }
        layer.eval()  # evaluation uses local counts: rank 0 alone runs a forward, which would hang on a collective
        if rank == 0:
            layer(half)
    return out


def test_global_batch_aux_loss_equals_the_single_process_loss_over_the_whole_batch():
    result = launch(rank_aux_against_whole_batch, WORLD, timeout=90)[0]
    glob, micro = result["global_batch"], result["micro_batch"]
    assert glob["aux"] == pytest.approx(glob["want_aux"], rel=1e-6)
    assert glob["grad_err"] <= 1e-6 * glob["grad_scale"]
    # The micro-batch loss balances each rank's half separately: another loss, another gradient.
    assert micro["want_aux"] == pytest.approx(glob["want_aux"], rel=1e-6)
    assert abs(micro["aux"] - micro["want_aux"]) > 1e-4
    assert micro["grad_err"] > 1e-4 * micro["grad_scale"]
