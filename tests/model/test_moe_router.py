"""Routers, router losses and the capacity rule, against hand computations."""

import math

import pytest
import torch

from forge.models.common.moe.dispatch import assign, expert_capacity
from forge.models.common.moe.losses import load_balancing_loss, router_z_loss, sequence_balancing_loss
from forge.models.common.moe.router import Router


def router_with_logits(kind: str, logits: torch.Tensor, top_k: int) -> Router:
    """A router whose gate maps the identity input to exactly `logits`."""
    tokens, experts = logits.shape
    router = Router(tokens, experts, top_k, kind)
    with torch.no_grad():
        router.gate.weight.copy_(logits.T)
    return router


LOGITS = torch.tensor([[2.0, 0.5, -1.0, 1.0], [-3.0, 0.0, 4.0, 0.1], [0.3, 0.0, -0.5, 1.0]])


def test_softmax_topk_picks_largest_and_renormalises():
    routing = router_with_logits("softmax_topk", LOGITS, 2)(torch.eye(3))
    assert routing.experts.tolist() == [[0, 3], [2, 3], [3, 0]]
    probs = LOGITS.softmax(-1)
    expected = torch.stack([probs[0, [0, 3]], probs[1, [2, 3]], probs[2, [3, 0]]])
    torch.testing.assert_close(routing.weights, expected / expected.sum(-1, keepdim=True))
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(3))
    torch.testing.assert_close(routing.probs, probs)


def test_sigmoid_topk_bias_changes_choice_not_weights():
    router = router_with_logits("sigmoid_topk", LOGITS, 2)
    routing = router(torch.eye(3))
    assert routing.experts.tolist() == [[0, 3], [2, 3], [3, 0]]
    router.expert_bias.copy_(torch.tensor([0.0, 5.0, 0.0, 0.0]))  # pushes expert 1 into every top-2
    biased = router(torch.eye(3))
    assert biased.experts[:, 0].tolist() == [1, 1, 1]
    scores = LOGITS.sigmoid()
    chosen = scores.gather(1, biased.experts)
    torch.testing.assert_close(biased.weights, chosen / chosen.sum(-1, keepdim=True))  # unbiased scores
    torch.testing.assert_close(biased.probs, scores / scores.sum(-1, keepdim=True))


def test_z_loss_matches_hand_computation():
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS.tolist()) / 3
    assert router_z_loss(LOGITS).item() == pytest.approx(expected, rel=1e-6)


def test_load_balancing_loss_is_switch_formula():
    probs = LOGITS.softmax(-1)
    experts = torch.tensor([[0, 3], [2, 3], [3, 0]])
    # f = assignment fractions over 6: expert0 2/6, expert1 0, expert2 1/6, expert3 3/6; P = column means.
    f = [2 / 6, 0.0, 1 / 6, 3 / 6]
    p = probs.mean(0).tolist()
    expected = 4 * sum(fi * pi for fi, pi in zip(f, p))
    assert load_balancing_loss(probs, experts, 4).item() == pytest.approx(expected, rel=1e-6)
    uniform = torch.full((8, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(uniform, balanced, 4).item() == pytest.approx(1.0)


def test_sequence_loss_averages_per_sequence_losses():
    torch.manual_seed(0)
    probs = torch.randn(2 * 5, 4).softmax(-1)
    experts = probs.topk(2, -1).indices
    per_seq = [load_balancing_loss(probs[i * 5 : (i + 1) * 5], experts[i * 5 : (i + 1) * 5], 4) for i in range(2)]
    expected = (per_seq[0] + per_seq[1]) / 2
    torch.testing.assert_close(sequence_balancing_loss(probs, experts, 4, batch=2), expected)


def test_dropless_sends_every_assignment_grouped_by_expert():
    torch.manual_seed(0)
    experts = torch.randint(0, 4, (50, 2))
    weights = torch.rand(50, 2)
    kept = assign(experts, weights, 4, capacity_factor=0.0)
    assert kept.counts.sum().item() == 100
    assert sorted(kept.tokens.tolist()) == sorted(torch.arange(50).repeat_interleave(2).tolist())
    chosen = experts.flatten()[torch.argsort(experts.flatten(), stable=True)]
    assert torch.equal(torch.arange(4).repeat_interleave(kept.counts), chosen)


def test_capacity_keeps_highest_weights_then_earliest_tokens():
    # 6 tokens, top-1, 2 experts, factor 1.0 -> capacity 3 per expert. Expert 0 gets 5 tokens.
    experts = torch.tensor([[0], [0], [1], [0], [0], [0]])
    weights = torch.tensor([[0.2], [0.9], [0.5], [0.2], [0.7], [0.2]])
    assert expert_capacity(6, 1, 2, 1.0) == 3
    kept = assign(experts, weights, 2, capacity_factor=1.0)
    # expert 0 keeps 0.9 (token 1), 0.7 (token 4), then the earliest 0.2 (token 0); drops tokens 3 and 5.
    # The dropped assignments follow the kept ones (static shapes), with weight 0.
    assert kept.tokens.tolist() == [1, 4, 0, 2, 3, 5]
    assert kept.counts.tolist() == [3, 1] and kept.routed.tolist() == [5, 1]
    torch.testing.assert_close(kept.weights, torch.tensor([0.9, 0.7, 0.2, 0.5, 0.0, 0.0]))
    again = assign(experts, weights, 2, capacity_factor=1.0)
    assert torch.equal(again.tokens, kept.tokens)
