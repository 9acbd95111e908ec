"""`forge-train --plan --materialize`: rank 0's shards allocated and initialised on the CPU under the fake process
group, through the sharded initialisation of real runs, with the values one process gives the whole model."""

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from forge.config import compose, validate
from forge.metrics.memory import peak_live_tensor_bytes
from forge.parallel.init import plain_name
from forge.parallel.mesh import build_mesh
from forge.parallel.plan import parallelize
from forge.planning import report as plan
from forge.train import build

CPU = torch.device("cpu")


def test_take_plan_flag_strips_materialize_and_records_it(monkeypatch):
    monkeypatch.setattr(plan, "MATERIALIZE", False)
    argv = ["forge-train", "--plan", "--materialize", "model=llama3_8b"]
    assert plan.take_plan_flag(argv) and argv == ["forge-train", "model=llama3_8b"]
    assert plan.MATERIALIZE


def test_materialize_without_plan_is_refused(monkeypatch):
    monkeypatch.setattr(plan, "MATERIALIZE", False)
    with pytest.raises(SystemExit) as exit_info:
        plan.take_plan_flag(["forge-train", "--materialize", "model=llama3_8b"])
    assert exit_info.value.code == 2 and not plan.MATERIALIZE


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=llama_125m", "parallel=fsdp", "parallel.world_size=8"],
        ["model=llama_tiny", "parallel=pp2_fsdp", "parallel.world_size=4"],
    ],
    ids=["fsdp8", "pp2_fsdp4"],
)
def test_materialized_bytes_are_four_per_parameter_rank0_holds(overrides):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        text = plan.plan_report(compose(overrides), materialize=True)
    local = int(re.search(r"rank 0 holds ([\d,]+)", text).group(1).replace(",", ""))
    found = re.search(r"materialized rank 0: ([\d,]+) bytes of float32 parameters \(([\d,]+) parameters\)", text)
    assert found, text
    nbytes, count = (int(n.replace(",", "")) for n in found.groups())
    assert count == local and nbytes == 4 * local
    assert re.search(r"in [\d.]+ s", text)
    # The plan's initialisation line against the allocator: beyond the shards and buffers, the live tensor bytes
    # of the plan (nothing but the fill allocates) peak at the host memory it states, and at least at its larger part.
    buffers = int(re.search(r"and ([\d,]+) bytes of buffers", text).group(1).replace(",", ""))
    live = peak_live_tensor_bytes(prof)
    found = re.search(r"beyond the runtime ([\d.]+) MiB \(scratch ([\d.]+) MiB, rotary tables ([\d.]+) MiB\)", text)
    host, scratch, tables = (float(n) * 2**20 for n in found.groups())
    rounding = 0.01 * 2**20  # the MiB are printed with two decimals
    assert max(scratch, tables) - rounding <= live - nbytes - buffers <= host + rounding, text


def expected_shard(whole: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of `whole`, from the plan's order alone: TP splits first, FSDP then splits TP's piece along
    dim 0 (each split as torch.chunk, like DTensor and FSDP2)."""
    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
    names = mesh.mesh_dim_names or ()
    piece = whole
    for i in sorted(range(mesh.ndim), key=lambda i: names[i] != "tp"):
        dim = getattr(param.placements[i], "dim", None)  # None: Replicate
        if dim is not None:
            piece = piece.chunk(mesh.size(i), dim)[coordinate[i]]
    return piece


def shards_under_fake_group(overrides: list[str], rank: int, world: int) -> dict[str, tuple[DTensor, torch.Tensor]]:
    """Rank `rank`'s parallelized model initialised under the fake process group: parameter -> (DTensor, local)."""
    cfg = compose(overrides)
    degrees = validate(cfg, world)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = build.build_meta_model(cfg)
        parallelize(model, build_mesh(degrees, "cpu"), degrees, cfg.parallel, CPU, "fp32")
        build.materialize_parallel(cfg, model, CPU, cfg.train.seed)
        return {plain_name(n): (p, p.to_local().clone()) for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["fsdp", "tp2_fsdp"])
def test_fake_group_shards_equal_slices_of_the_one_process_model(layout):
    overrides = ["model=llama_tiny", f"parallel={layout}", "parallel.world_size=4"]
    one = compose(["model=llama_tiny", "parallel=single"])
    reference = build.build_meta_model(one)
    build.materialize(reference, CPU, one.train.seed)
    whole = dict(reference.named_parameters())
    for rank in range(4):
        shards = shards_under_fake_group(overrides, rank, 4)
        assert set(shards) == set(whole)
        for name, (param, local) in shards.items():
            assert isinstance(param, DTensor), name
            assert torch.equal(local, expected_shard(whole[name].detach(), param)), (layout, rank, name)
