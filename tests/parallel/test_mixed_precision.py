"""FSDP2 mixed precision and gradient accumulation on real gloo ranks.

Under train.dtype=bf16 the all-gathered parameters are bf16 and gradients are reduced in fp32 (the sharded
parameters stay fp32 master weights); with accumulation the gradients held between micro-batches are the rank's
shard, not an unsharded copy of the model (unless parallel.defer_grad_sync=true asks for that).
"""

from pathlib import Path

import pytest
import torch

from forge.config import compose
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY, curves

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BF16_REL = 2**-6
"""bf16 keeps 8 significant bits (unit roundoff 2**-8). Both compute on bf16 weights (one process on its one copy
per step, forge.train.compute_weights), but the ranks' gradients of half the batch each are summed by the
reduction, so 4 steps of losses differ by a few roundoffs at most (measured: 7e-5 relative; 8e-5 with the one
process on fp32 weights under autocast, `parallel.param_dtype=fp32`)."""


def fsdp_groups(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]


class Probe(Trainer):
    """Records, before each micro-batch's forward, the gradient bytes held (sharded grads + FSDP's unsharded
    accumulators) and, during the forward, the dtype of an all-gathered weight."""

    def build_model_and_data(self) -> None:
        super().build_model_and_data()
        self.grad_bytes: list[int] = []
        self.gathered: list[str] = []
        wq = self.model.layers["0"].attention.wq
        wq.register_forward_pre_hook(lambda module, args: self.gathered.append(str(module.weight.dtype)))

    def record_grad_bytes(self) -> None:
        held = 0
        for group in fsdp_groups(self.model):
            for param in group.fsdp_params:
                grad = param.sharded_param.grad
                held += 0 if grad is None else grad.to_local().numel() * grad.element_size()
                for acc in (param.unsharded_accumulated_grad, getattr(param, "_unsharded_param", None)):
                    acc = acc.grad if isinstance(acc, torch.nn.Parameter) else acc
                    acc = getattr(acc, "_local_tensor", acc)  # an expert-parallel DTensor: this rank's experts
                    held += 0 if acc is None else acc.numel() * acc.element_size()
        self.grad_bytes.append(held)

    def __init__(self, cfg, run_dir: Path):
        super().__init__(cfg, run_dir)
        loss_fn = self.loss_fn

        def recorded(*args, **kwargs):  # the training loss runs each micro-batch's forward
            self.record_grad_bytes()
            return loss_fn(*args, **kwargs)

        self.loss_fn = recorded


def run(scenarios: dict[str, list[str]], root: str) -> dict:
    from forge.parallel.dist import is_main_process

    out = {}
    for name, overrides in scenarios.items():
        trainer = Probe(compose([*TINY, *overrides]), Path(root) / name)
        trainer.fit()
        groups = fsdp_groups(trainer.model)
        out[name] = curves(trainer.run_dir) | {
            "gathered": trainer.gathered,
            "param_dtype": sorted({str(g.mp_policy.param_dtype) for g in groups}),
            "reduce_dtype": sorted({str(g.mp_policy.reduce_dtype) for g in groups}),
            "master": sorted({str(p.sharded_param.dtype) for g in groups for p in g.fsdp_params}),
            "shard_bytes": sum(p.sharded_param.to_local().numel() * 4 for g in groups for p in g.fsdp_params),
            "model_bytes": trainer.n_params * 4,
            "grad_bytes": max(trainer.grad_bytes[1:4]),  # before micro-batches 2..4 of the first step
        }
    return out if is_main_process() else {}


def test_bf16_gathers_bf16_reduces_fp32_and_follows_one_process(tmp_path):
    bf16 = ["train.dtype=bf16"]
    one = launch(run, 1, {"one": ["parallel=single", *bf16]}, str(tmp_path / "one"))[0]["one"]
    two = launch(run, 2, {"fsdp": ["parallel=fsdp", *bf16]}, str(tmp_path / "two"))[0]["fsdp"]
    assert set(two["gathered"]) == {"torch.bfloat16"} and set(one["gathered"]) == {"torch.bfloat16"}
    assert two["param_dtype"] == ["torch.bfloat16"] and two["reduce_dtype"] == ["torch.float32"]
    assert two["master"] == ["torch.float32"]
    for key in ("loss", "val_loss"):
        assert two[key] == pytest.approx(one[key], rel=BF16_REL), key


def test_accumulation_keeps_gradients_sharded_unless_deferred(tmp_path):
    accum = ["parallel=fsdp", "train.micro_batch_size=1"]  # 8 / (1 x 2 ranks) = 4 micro-batches per step
    runs = launch(run, 2, {"each": accum, "deferred": [*accum, "parallel.defer_grad_sync=true"]}, str(tmp_path))[0]
    reference = launch(run, 1, {"one": ["parallel=single"]}, str(tmp_path / "one"))[0]["one"]
    each, deferred = runs["each"], runs["deferred"]
    assert each["grad_bytes"] <= each["shard_bytes"]  # only the shard's gradients
    assert each["shard_bytes"] < 0.6 * each["model_bytes"]
    assert deferred["grad_bytes"] >= 0.99 * deferred["model_bytes"]  # unsharded: the whole model on each rank
    for run_ in (each, deferred):
        for key in ("loss", "grad_norm", "val_loss"):
            assert run_[key] == pytest.approx(reference[key], rel=1e-4), key


class ChunkProbe(Trainer):
    """Records, before each training chunk's forward through this rank's first block (not evaluation's), the
    gradient bytes its stage holds (sharded grads + FSDP's unsharded accumulators)."""

    def build_model_and_data(self) -> None:
        super().build_model_and_data()
        self.grad_bytes: list[int] = []
        part = self.pipeline.parts[0]
        first = part.layers[next(iter(part.layers.keys()))]
        first.register_forward_pre_hook(lambda module, args: self.record(part) if module.training else None)

    def record(self, part) -> None:
        self.grad_bytes.append(held_grad_bytes(part))


def held_grad_bytes(model) -> int:
    held = 0
    for group in fsdp_groups(model):
        for param in group.fsdp_params:
            grad = param.sharded_param.grad
            held += 0 if grad is None else grad.to_local().numel() * grad.element_size()
            unsharded = getattr(param, "_unsharded_param", None)
            for acc in (param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad):
                held += 0 if acc is None else acc.numel() * acc.element_size()
    return held


def run_chunks(scenarios: dict[str, list[str]], root: str) -> dict:
    out = {}
    for name, overrides in scenarios.items():
        trainer = ChunkProbe(compose([*TINY, *overrides]), Path(root) / name)
        trainer.fit()
        groups = fsdp_groups(trainer.pipeline.parts[0])
        out[name] = curves(trainer.run_dir) | {
            "shard_bytes": sum(p.sharded_param.to_local().numel() * 4 for g in groups for p in g.fsdp_params),
            "grad_bytes": max(trainer.grad_bytes[1:4]),  # before chunks 2..4 of the first step
        }
    return out


def test_a_pipeline_keeps_gradients_sharded_between_chunks_unless_deferred(tmp_path):
    """torch's PipelineStage holds a stage's unsharded gradients from the first chunk's backward to the end of the
    step; forge's ReducingStage reduce-scatters after each chunk (the default under FSDP)."""
    chunks = ["parallel=pp2_fsdp", "train.micro_batch_size=4", "parallel.microbatches=4"]  # 1 micro-batch, 4 chunks
    scenarios = {"each": chunks, "deferred": [*chunks, "parallel.defer_grad_sync=true"]}
    first_stage = launch(run_chunks, 4, scenarios, str(tmp_path))[0]  # rank 0: stage 0, FSDP over 2
    each, deferred = first_stage["each"], first_stage["deferred"]
    assert each["grad_bytes"] <= each["shard_bytes"]  # only the shard's gradients
    assert deferred["grad_bytes"] >= 1.9 * deferred["shard_bytes"]  # unsharded over the 2 FSDP ranks
    for key in ("loss", "grad_norm", "val_loss"):
        assert each[key] == pytest.approx(deferred[key], rel=1e-5), key


def run_deferred_estimate(overrides: list[str], root: str) -> dict:
    """The gradient bytes a rank holds between deferred micro-batches, beside what --plan's estimate counts."""
    from forge.config.degrees import resolve_degrees
    from forge.models.common.moe.balance import moe_layers
    from forge.parallel.dist import is_main_process
    from forge.parallel.plan import count_local_parameters
    from forge.planning.memory import estimate_memory

    cfg = compose([*TINY, *overrides])
    trainer = Probe(cfg, Path(root))
    model = trainer.model
    local = count_local_parameters(model)  # before a forward, after which FSDP's root stays unsharded
    experts = sum(count_local_parameters(layer.experts) for _, layer in moe_layers(model))
    trainer.fit()
    degrees = resolve_degrees(cfg.parallel, 2)
    args = model.args
    mem = estimate_memory(args, degrees, local, args.n_layers, True, 1, 32, 1.0, 4, deferred_sync=True,
                          local_experts=experts)  # fmt: skip
    out = {"held": max(trainer.grad_bytes[1:4]), "estimated": mem.grads, "local": local, "experts": experts}
    return out if is_main_process() else {}


def test_deferred_expert_gradients_are_planned_over_their_own_fsdp_group(tmp_path):
    """ep 2 over 2 ranks: each rank's 2 of 4 experts are whole (their FSDP group is dp_shard / ep = 1 rank), so
    deferring the sync doubles the other parameters' gradients but not the experts'."""
    moe = ["model=moe_tiny", "model.moe.num_experts=4", "model.moe.expert_ffn_dim=1024"]
    overrides = [*moe, "parallel=ep2_fsdp", "train.micro_batch_size=1", "parallel.defer_grad_sync=true"]
    got = launch(run_deferred_estimate, 2, overrides, str(tmp_path))[0]
    assert got["experts"] > 0.2 * got["local"]  # the experts are a share the old count (all x 2) would miss
    assert got["held"] == pytest.approx(got["estimated"], rel=0.01)
