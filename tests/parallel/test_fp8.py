"""Float8 training (torchao) on CPU: the blocks' linears become Float8Linear, the head stays high precision, the
loss stays close to bf16, and FSDP with float8 all-gather and tensor parallelism with float8 styles, each over 2
ranks, match the one-process fp8 run."""

import pytest

from tests.parallel.harness import launch
from tests.parallel.scenarios import run_scenarios

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BF16 = ["train.dtype=bf16"]
FP8 = [*BF16, "parallel.fp8=true"]
# Measured on CPU: fp8 vs bf16 within 1e-3 relative over 4 steps; FSDP's float8 all-gather reorders reductions.
FP8_VS_BF16_RTOL = 5e-3
FSDP_RTOL = 2e-3


def float8_layout(run_dir_root: str) -> dict:
    from forge.config import compose
    from forge.train.trainer import Trainer
    from tests.parallel.scenarios import TINY

    trainer = Trainer(compose([*TINY, *FP8]), f"{run_dir_root}/layout")
    block = trainer.model.layers["0"]
    return {"wq": type(block.attention.wq).__name__, "output": type(trainer.model.output).__name__}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp8"))
    runs = launch(
        run_scenarios, 1, {"bf16": [*BF16, "train.micro_batch_size=8"], "fp8": [*FP8, "train.micro_batch_size=8"]}, root
    )[0]
    return runs | {"layout": launch(float8_layout, 1, root)[0]}


def test_float8_swaps_the_block_linears_and_keeps_the_head(single):
    assert single["layout"] == {"wq": "Float8Linear", "output": "Linear"}


def test_fp8_loss_is_close_to_bf16(single):
    assert single["fp8"]["loss"] != single["bf16"]["loss"]  # fp8 really ran
    assert single["fp8"]["loss"] == pytest.approx(single["bf16"]["loss"], rel=FP8_VS_BF16_RTOL)


def test_fsdp_with_float8_all_gather_matches_one_process(single, tmp_path):
    run = launch(run_scenarios, 2, {"fp8_fsdp": [*FP8, "parallel=fsdp", "train.micro_batch_size=4"]}, str(tmp_path))
    got = run[0]["fp8_fsdp"]
    assert got["wq_placements"] == ["S(0)"]
    assert got["loss"] == pytest.approx(single["fp8"]["loss"], rel=FSDP_RTOL)


def test_tensor_parallel_float8_matches_one_process(single, tmp_path):
    """fp8 under tp2: the blocks' linears are float8 and split with torchao's float8 styles (on gloo gathered in
    bf16, then cast with the whole tensors' scales), the losses those of one fp8 process."""
    run = launch(run_scenarios, 2, {"fp8_tp2": [*FP8, "parallel=tp2", "train.micro_batch_size=8"]}, str(tmp_path))
    got = run[0]["fp8_tp2"]
    assert got["wq_type"] == "Float8Linear" and got["wq_placements"] == ["S(0)"]
    assert got["loss"] == pytest.approx(single["fp8"]["loss"], rel=FSDP_RTOL)


def test_float8_keeps_routers_and_odd_shapes_in_high_precision():
    from torch import nn

    from forge.parallel.plan import float8_filter

    gate, shared, odd = nn.Linear(64, 4, bias=False), nn.Linear(64, 128), nn.Linear(64, 40)
    assert not float8_filter(gate, "layers.1.feed_forward.router.gate")
    assert float8_filter(shared, "layers.1.feed_forward.shared_experts.w1")
    assert not float8_filter(odd, "layers.0.attention.wq")  # 40 is not a multiple of 16
    assert not float8_filter(shared, "output")


def test_emulated_float8_matmuls_give_the_float8_kernels_results():
    """Off CUDA the float8 linears are emulated (forge.parallel.plan.apply_float8): the same float8 operands,
    dequantised in fp32 and multiplied there. They match torch's `_scaled_mm` kernel up to fp32 roundings and the
    summation order: each output element of k terms within (2k + 3) * 2**-24 times the sum of its products'
    magnitudes, forward and backward; and both differ from the unquantised product by the float8 rounding, far more."""
    import copy

    import torch
    from torch import nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from forge.config.degrees import Degrees
    from forge.parallel.plan import apply_float8

    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(64, 96, bias=False)})
    kernel = copy.deepcopy(model)
    apply_float8(model, Degrees(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1), torch.device("cpu"))
    convert_to_float8_training(kernel, config=Float8LinearConfig(emulate=False))
    assert model.layers["0"].config.emulate and not kernel.layers["0"].config.emulate

    x = torch.randn(32, 64)
    grad_out = torch.randn(32, 96)
    results = []
    for m in (model, kernel):
        xi = x.clone().requires_grad_()
        out = m.layers["0"](xi)
        out.backward(grad_out)
        results.append((out, xi.grad, m.layers["0"].weight.grad))
    weight = model.layers["0"].weight.detach()
    unquantised = (x @ weight.T, grad_out @ weight, grad_out.T @ x)
    # |a| @ |b| of the unquantised operands; float8 rounding moves a product by at most 1.125 x 1.0625 (e5m2 times
    # e4m3: 2**-3 and 2**-4 relative), so 1.3 covers it
    magnitudes = (x.abs() @ weight.abs().T, grad_out.abs() @ weight.abs(), grad_out.abs().T @ x.abs())
    pairs = zip(*results, strict=True)
    for (emulated, ref), plain, magnitude, k in zip(pairs, unquantised, magnitudes, (64, 96, 32), strict=True):
        bound = (2 * k + 3) * 2**-24 * 1.3 * magnitude
        assert ((emulated - ref).abs() <= bound).all(), (emulated - ref).abs().max()
        assert (emulated - plain).abs().max() > 10 * bound.max()  # the float8 rounding happened
