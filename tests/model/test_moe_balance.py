"""Balanced selection (MoEArgs.balanced_selection): the solved offsets, the router that applies them, the bias that
takes them, and the default MoE that keeps its balance where sign updates let it collapse."""

import json

import pytest
import torch

from forge.config import compose
from forge.metrics.plot import expert_load_extremes
from forge.models.common.moe.args import MoEArgs
from forge.models.common.moe.balance import router_losses, update_router_biases
from forge.models.common.moe.layer import MoE
from forge.models.common.moe.router import Router, balancing_offsets
from forge.train.trainer import Trainer


def shared_preference(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Scores as a collapsing run draws them: one preference every token shares, a little token-to-token spread."""
    generator = torch.Generator().manual_seed(seed)
    return torch.linspace(0, 1, experts) + 0.01 * torch.randn(tokens, experts, generator=generator)


def counts(choice: torch.Tensor, k: int) -> torch.Tensor:
    return torch.bincount(choice.topk(k, dim=-1).indices.flatten(), minlength=choice.shape[1])


@pytest.mark.parametrize(("experts", "k"), [(8, 2), (64, 6)])
def test_offsets_give_each_expert_its_share(experts, k):
    choice = shared_preference(512, experts)
    share = 512 * k / experts
    assert counts(choice, k).max() == 512  # without offsets the top-k experts take every token
    balanced = counts(choice + balancing_offsets(choice, k), k)
    # The margins are continuous, so each round's quantile is exact for one expert alone; the rounds leave a few
    # tokens of cross-talk between experts moving together.
    assert balanced.min() >= 0.9 * share and balanced.max() <= 1.1 * share, balanced.tolist()


def test_offsets_reach_for_experts_that_few_tokens_can_take():
    choice = shared_preference(256, 8)
    choice[:192, :4] = float("-inf")  # three quarters of the tokens cannot take experts 0-3
    offsets = balancing_offsets(choice, 2)
    assert torch.isfinite(offsets).all()
    assert offsets[:4].min() > offsets[4:].max()  # pushed up as far as they go
    # Short of their even share (64 each) they take all they can: both choices of the 64 tokens that reach them.
    assert counts(choice + offsets, 2)[:4].sum() == 128


def test_offsets_of_nothing_to_balance_are_zero():
    assert torch.equal(balancing_offsets(torch.rand(0, 8), 2), torch.zeros(8))
    assert torch.equal(balancing_offsets(torch.rand(16, 4), 4), torch.zeros(4))


def test_router_balances_in_training_only_and_keeps_the_weights_unbiased():
    torch.manual_seed(0)
    router = Router(16, 8, 2, "sigmoid_topk", balanced=True)
    x = torch.randn(400, 16) + 3 * torch.randn(16)  # a large part shared by every token
    with torch.no_grad():
        router.gate.weight.add_(torch.linspace(0, 0.3, 8).unsqueeze(1))
    trained = router(x)
    assert trained.offsets is not None
    assert torch.bincount(trained.experts.flatten(), minlength=8).min() >= 0.9 * 100
    scores = router.gate(x).float().sigmoid()
    top = scores.gather(-1, trained.experts)
    torch.testing.assert_close(trained.weights, top / top.sum(-1, keepdim=True))
    evaluated = router.eval()(x)
    assert evaluated.offsets is None
    assert torch.equal(evaluated.experts, scores.topk(2, dim=-1).indices)


def test_sigmoid_bias_moves_to_the_mean_offsets_over_micro_batches_and_ranks():
    torch.manual_seed(0)
    layer = MoE(16, 32, MoEArgs(router="sigmoid_topk", balanced_selection=True))
    shift = torch.zeros(16)
    shift[0] = 4.0
    offsets = []
    for _ in range(2):  # two micro-batches of one step
        layer(torch.randn(64, 16) + shift)
        offsets.append(layer.last_offsets)
        router_losses(layer)

    def two_alike_ranks(flat: torch.Tensor) -> None:
        flat.mul_(2)

    update_router_biases(layer, all_reduce=two_alike_ranks)
    torch.testing.assert_close(layer.router.expert_bias, (offsets[0] + offsets[1]) / 2)


def test_softmax_router_keeps_no_bias():
    layer = MoE(16, 32, MoEArgs(balanced_selection=True))
    layer(torch.randn(64, 16))
    router_losses(layer)
    update_router_biases(layer)
    assert layer.router.expert_bias.abs().sum() == 0
    assert "router.expert_bias" not in layer.state_dict()


def loads_after(tmp_path, balanced: bool, steps: int = 25) -> list[tuple[float, float]]:
    """(largest, smallest) expert share over the layers at each step from 20 on, as multiples of the even share."""
    overrides = ["model=moe_tiny", "train.seq_len=32", f"train.steps={steps}", "train.log_every=1"]
    overrides += ["train.eval_every=0", "train.eval_batches=1", "metrics.console=quiet", "train.dtype=fp32"]
    overrides += [f"model.moe.balanced_selection={str(balanced).lower()}"]
    Trainer(compose(overrides), tmp_path).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [expert_load_extremes(r) for r in records if r.get("step", 0) >= 20 and "loss" in r]


def test_default_moe_keeps_its_balance_where_sign_updates_collapse(tmp_path):
    """The issue's measure at a few seconds' size: from step 20 on no expert above 3x its share, none without
    tokens, at the default lr and warmup; the control without balanced selection fails it."""
    assert compose(["model=moe"]).model.moe.balanced_selection
    balanced = loads_after(tmp_path / "balanced", True)
    assert balanced and all(top < 3 and low > 0 for top, low in balanced), balanced
    control = loads_after(tmp_path / "control", False)
    assert any(top >= 3 or low == 0 for top, low in control), control


def test_forge_plot_draws_the_expert_loads(tmp_path):
    import matplotlib.image

    from forge.metrics.plot import plot_runs

    record = {"step": 3, "loss": 5.0, "moe/0/load_max": 1.5, "moe/1/load_max": 3.5, "moe/0/load_min": 0.2}
    record["moe/1/load_min"] = 0.0
    assert expert_load_extremes(record) == (3.5, 0.0)
    assert expert_load_extremes({"step": 3, "loss": 5.0}) is None
    widths = {}
    for name, extra in (("dense", {}), ("moe", record)):
        run = tmp_path / name
        run.mkdir()
        base = {"lr": 1e-3, "tokens_per_s": 100.0}
        lines = [json.dumps({**base, **extra, "step": s, "loss": 5.0 - s / 10}) for s in (1, 2)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        widths[name] = matplotlib.image.imread(plot_runs([run], tmp_path / f"{name}.png", dpi=20)).shape[1]
    assert widths["moe"] == widths["dense"] * 4 // 3  # a fourth panel
