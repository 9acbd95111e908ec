"""The MoE layer against independent per-token computations, grouped GEMM against the loop, bias balancing."""

import pytest
import torch
import torch.nn.functional as F

from forge.models.common.moe import MoE, moe_metrics, router_losses, update_router_biases
from forge.models.common.moe import layer as layer_module
from forge.models.common.moe.dispatch import assign, local_dispatch
from forge.models.common.moe.experts import GroupedExperts, batched_swiglu, grouped_mm_available, grouped_swiglu
from forge.models.llama import MoEArgs, TransformerArgs, build_transformer
from forge.models.llama.transformer import FeedForward

DIM, HIDDEN = 16, 32


def make_moe(seed: int = 0, **overrides) -> MoE:
    args = MoEArgs(**{"num_experts": 4, "top_k": 2, **overrides})
    torch.manual_seed(seed)
    moe = MoE(DIM, HIDDEN, args)
    moe.init_weights(0.2, 0.2)
    return moe


def swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def reference(moe: MoE, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token by token: sum over the chosen experts of weight * expert(token), plus the shared experts. With a
    capacity, each expert serves only its `capacity` highest-weight assignments (ties: the earlier token)."""
    tokens = x.reshape(-1, DIM)
    routing = moe.router(tokens)
    ex = moe.experts
    served = set()
    for e in range(moe.args.num_experts):
        claims = [
            (-routing.weights[t, slot].item(), t, slot)
            for t in range(tokens.shape[0])
            for slot in range(moe.args.top_k)
            if routing.experts[t, slot].item() == e
        ]
        served.update((t, slot) for _, t, slot in sorted(claims)[:capacity])
    rows = []
    for t in range(tokens.shape[0]):
        row = torch.zeros(DIM)
        for slot, (e, w) in enumerate(zip(routing.experts[t].tolist(), routing.weights[t])):
            if (t, slot) not in served:
                continue
            row = row + w * swiglu(tokens[t], ex.w1[e], ex.w2[e], ex.w3[e])
        if moe.shared_experts is not None:
            row = row + moe.shared_experts(tokens[t])
        rows.append(row)
    return torch.stack(rows).view(x.shape)


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk"])
@pytest.mark.parametrize("shared", [0, 2])
def test_matches_per_token_reference(router, shared):
    moe = make_moe(router=router, num_shared_experts=shared)
    x = torch.randn(2, 5, DIM)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.75], ids=["dropless", "capacity"])
def test_outputs_and_gradients_match_the_per_token_reference(grouped, capacity_factor):
    """The one-permutation dispatch (grouped GEMMs, dropped rows riding with the last expert and masked) against
    the token-by-token reference: outputs, the input's gradient and every weight's."""
    moe = make_moe(capacity_factor=capacity_factor, grouped_mm=grouped)
    x = torch.randn(2, 12, DIM)
    grad = torch.randn(2, 12, DIM)
    capacity = 9 if capacity_factor else None  # ceil(0.75 * 24 * 2 / 4)
    results = []
    for forward in (moe, lambda inputs: reference(moe, inputs, capacity)):
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        out = forward(xi)
        out.backward(grad)
        results.append([out.detach(), xi.grad] + [p.grad.clone() for p in moe.parameters()])
    if capacity_factor:
        assert moe.last_kept.sum() < moe.last_routed.sum()  # some assignments were dropped
    for ours, expected in zip(*results):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_each_token_sums_its_experts_in_fp32_under_autocast(monkeypatch):
    """Under bf16 autocast the experts run in bf16 and each token's weighted sum of their outputs stays fp32 (a bf16
    product there would round the routing weights and the sum, 1e-3 apart)."""
    moe = make_moe()
    x = torch.randn(2, 12, DIM)
    seen = {}

    def recording_assign(*args, **kwargs):
        seen["kept"] = assign(*args, **kwargs)
        return seen["kept"]

    def recording_dispatch(rows, counts, experts):
        seen["out"] = local_dispatch(rows, counts, experts)
        return seen["out"]

    monkeypatch.setattr(layer_module, "assign", recording_assign)
    moe.dispatch = recording_dispatch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x).view(-1, DIM)
    kept, expert_out = seen["kept"], seen["out"]
    assert expert_out.dtype == torch.bfloat16 and out.dtype == torch.float32
    per_slot = expert_out.detach().float()[kept.slots].view(-1, 2, DIM)
    expected = (per_slot * kept.weights.detach()[kept.slots].view(-1, 2, 1)).sum(1)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-6, atol=1e-6)


def test_default_path_runs_on_the_meta_device():
    """Grouped GEMMs, the capacity limit and balanced selection keep every shape static, so a forward and backward
    run on the meta device, where reading a value on the host (.tolist(), a boolean mask, bincount) fails."""
    for overrides in ({"balanced_selection": True}, {"capacity_factor": 1.0, "router": "sigmoid_topk"}):
        with torch.device("meta"):
            moe = make_meta_moe(**overrides)
            x = torch.randn(2, 8, DIM, dtype=torch.bfloat16, requires_grad=True)
        (moe(x).sum() + moe.last_aux_loss).backward()
        assert moe.experts.w1.grad.shape == moe.experts.w1.shape
        padded = moe.experts.forward_grouped(x.view(16, DIM), torch.tensor([5, 0, 7, 4], device="meta"), align=8)
        assert padded.shape == (16, DIM)
    with torch.device("meta"):
        loop = make_meta_moe(grouped_mm=False)
    with pytest.raises((NotImplementedError, RuntimeError)):  # the loop reads the counts on the host
        loop(torch.randn(2, 8, DIM, dtype=torch.bfloat16, device="meta"))


def make_meta_moe(**overrides) -> MoE:
    return MoE(DIM, HIDDEN, MoEArgs(**{"num_experts": 4, "top_k": 2, **overrides})).to(torch.bfloat16)


@pytest.mark.parametrize("align", [3, 8])
def test_groups_padded_for_a_kernel_give_the_unpadded_result(align):
    """CUDA's grouped GEMM needs each group padded to 16 bytes of rows; on a CPU the padded path is forced and
    must give the unpadded outputs and gradients, dropped rows (past counts.sum()) included."""
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, 4)
    experts.init_weights(0.2, 0.2)
    counts = torch.tensor([5, 0, 7, 2])  # 14 kept, 2 dropped rows ride with the last expert
    x = torch.randn(16, DIM)
    grad = torch.randn(16, DIM)
    results = []
    for pad in (1, align):
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        out = experts.forward_grouped(xi, counts, align=pad)
        out.backward(grad)
        results.append([out.detach(), xi.grad] + [p.grad.clone() for p in experts.parameters()])
    for padded, plain in zip(*results):
        torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_gemms_of_padded_groups_give_the_grouped_result(dtype):
    """The CPU's batched path (each group padded to the longest) against the grouped GEMMs: outputs and gradients,
    an empty group and the dropped rows riding with the last group included."""
    grouped_or_skip(dtype)
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, 4)
    experts.init_weights(0.2, 0.2)
    experts = experts.to(dtype)
    sizes = torch.tensor([5, 0, 7, 4])  # 2 of the last group's rows are dropped ones
    x, grad = torch.randn(16, DIM, dtype=dtype), torch.randn(16, DIM, dtype=dtype)
    weights = (experts.w1, experts.w2, experts.w3)
    results = []
    for path in (
        lambda xi: grouped_swiglu(xi, sizes.cumsum(0).to(torch.int32), *weights),
        lambda xi: batched_swiglu(xi, sizes, 7, *weights),
    ):
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        out = path(xi)
        out.backward(grad)
        results.append([out.detach(), xi.grad] + [p.grad.clone() for p in experts.parameters()])
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for grouped, batched in zip(*results):
        torch.testing.assert_close(batched, grouped, **tol)


def test_balanced_groups_take_the_batched_path_on_a_cpu(monkeypatch):
    """forward_grouped on a CPU pads near-equal groups and runs batched GEMMs; far-apart groups keep the grouped
    GEMMs (padding them would multiply the work)."""
    import forge.models.common.moe.experts as experts_module

    taken = []
    monkeypatch.setattr(experts_module, "batched_swiglu", lambda *a: taken.append("batched") or a[0])
    monkeypatch.setattr(experts_module, "grouped_swiglu", lambda *a: taken.append("grouped") or a[0])
    experts = GroupedExperts(DIM, HIDDEN, 4)
    experts.forward_grouped(torch.randn(16, DIM), torch.tensor([4, 4, 4, 4]))
    experts.forward_grouped(torch.randn(16, DIM), torch.tensor([13, 1, 1, 1]))
    assert taken == ["batched", "grouped"]


def test_no_rows_give_no_rows():
    """An expert-parallel rank or part that received no token: an empty output with the model's width."""
    experts = GroupedExperts(DIM, HIDDEN, 4)
    assert experts.forward_grouped(torch.randn(0, DIM), torch.zeros(4, dtype=torch.long)).shape == (0, DIM)
    assert batched_swiglu(torch.randn(0, DIM), torch.zeros(4, dtype=torch.long), 0, experts.w1, experts.w2,
                          experts.w3).shape == (0, DIM)  # fmt: skip


def test_one_expert_top1_equals_dense_swiglu():
    moe = make_moe(num_experts=1, top_k=1)
    dense = FeedForward(DIM, HIDDEN)
    with torch.no_grad():
        dense.w1.weight.copy_(moe.experts.w1[0].T)
        dense.w3.weight.copy_(moe.experts.w3[0].T)
        dense.w2.weight.copy_(moe.experts.w2[0].T)
    x = torch.randn(3, 7, DIM)
    torch.testing.assert_close(moe(x), dense(x), rtol=1e-5, atol=1e-6)


def test_capacity_drops_only_the_lowest_weights():
    moe = make_moe(num_experts=4, top_k=1, capacity_factor=0.5)
    x = torch.randn(1, 16, DIM)
    out = moe(x).view(16, DIM)
    routing = moe.router(x.view(16, DIM))
    capacity = 2  # ceil(0.5 * 16 * 1 / 4)
    for e in range(4):
        mine = (routing.experts[:, 0] == e).nonzero().flatten()
        ranked = mine[torch.argsort(routing.weights[mine, 0], descending=True, stable=True)]
        for rank, t in enumerate(ranked.tolist()):
            dropped = rank >= capacity
            assert (out[t].abs().sum().item() == 0) == dropped
    assert moe.last_kept.sum().item() == sum(min(c, capacity) for c in moe.last_routed.tolist())


def test_dropless_sends_every_token():
    moe = make_moe(num_experts=4, top_k=2, capacity_factor=0.0)
    moe(torch.randn(4, 8, DIM))
    assert moe.last_kept.tolist() == moe.last_routed.tolist()
    assert moe.last_kept.sum().item() == 4 * 8 * 2


def grouped_or_skip(dtype: torch.dtype) -> None:
    if not grouped_mm_available():
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    try:
        torch._grouped_mm(
            torch.randn(8, 16, dtype=dtype), torch.randn(2, 16, 16, dtype=dtype), offs=torch.tensor([3, 8]).int()
        )
    except RuntimeError as err:
        pytest.skip(f"torch._grouped_mm does not run in {dtype} on CPU: {err}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_loop(dtype):
    grouped_or_skip(dtype)
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, 4)
    experts.init_weights(0.2, 0.2)
    experts = experts.to(dtype)
    counts = torch.tensor([5, 0, 7, 2])  # the last 2 rows (dropped) ride with the last expert on both paths
    x = torch.randn(16, DIM, dtype=dtype)
    grad = torch.randn(16, DIM, dtype=dtype)
    results = []
    for path in (experts.forward_loop, experts.forward_grouped):
        xi = x.clone().requires_grad_()
        path(xi, counts).backward(grad)
        results.append((path(xi, counts).detach(), xi.grad, experts.w1.grad.clone(), experts.w2.grad.clone()))
        experts.zero_grad()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, **tol)


def test_bias_update_raises_underloaded_and_lowers_overloaded():
    moe = make_moe(router="sigmoid_topk", bias_update_rate=0.1)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0] = 1.0  # expert 0 scores highest for positive inputs
    x = torch.rand(2, 8, DIM)
    moe(x)
    router_losses(moe)
    load = moe.last_routed.float()
    update_router_biases(moe)
    bias = moe.router.expert_bias
    assert bias[0].item() == pytest.approx(-0.1)  # overloaded
    for e in range(4):
        expected = 0.1 * torch.sign(load.mean() - load[e]).item()
        assert bias[e].item() == pytest.approx(expected)
    metrics = moe_metrics(moe)
    assert metrics["moe/0/load_max"] > 1.0
    softmax = make_moe(router="softmax_topk")
    softmax(x)
    router_losses(softmax)
    update_router_biases(softmax)
    assert softmax.router.expert_bias.abs().sum().item() == 0  # the softmax router has no bias balancing


def test_router_losses_weight_aux_and_z_by_their_coefs():
    moe = make_moe(aux_loss_coef=0.5, z_loss_coef=0.25)
    moe(torch.randn(2, 6, DIM))
    expected = 0.5 * moe.last_aux_loss + 0.25 * moe.last_z_loss
    torch.testing.assert_close(router_losses(moe), expected)


def test_expert_slice_initialises_like_the_whole():
    torch.manual_seed(3)
    whole = GroupedExperts(DIM, HIDDEN, 4)
    whole.init_weights(0.1, 0.05)
    part = GroupedExperts(DIM, HIDDEN, 4)
    part.keep_slice(2, 2)
    torch.manual_seed(3)
    part.init_weights(0.1, 0.05)
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(part, name), getattr(whole, name)[2:4])


def test_meta_build_initialises_router_bias_and_trains_in_a_transformer():
    moe = MoEArgs(num_experts=4, top_k=2, expert_ffn_dim=32, router="sigmoid_topk", num_shared_experts=1)
    args = TransformerArgs(dim=DIM, n_layers=2, n_heads=2, vocab_size=64, ffn_dim=32, moe=moe)
    model = build_transformer(args)
    assert all(torch.equal(m.router.expert_bias, torch.zeros(4)) for m in model.modules() if isinstance(m, MoE))
    logits = model(torch.randint(0, 64, (2, 8)))
    loss = F.cross_entropy(logits.flatten(0, 1), torch.randint(0, 64, (16,))) + router_losses(model)
    loss.backward()
    assert model.layers["0"].feed_forward.router.gate.weight.grad.abs().sum() > 0
    assert model.layers["1"].feed_forward.experts.w2.grad.abs().sum() > 0
