"""The mesh shape of each layout and the plan's single-process behaviour (no process group needed)."""

import sys

import pytest
import torch
from omegaconf import OmegaConf

from forge.config.degrees import Degrees
from forge.config.schema import ParallelConfig
from forge.models.llama import Transformer, TransformerArgs
from forge.parallel.mesh import mesh_shape
from forge.parallel.plan import fsdp_mesh, parallelize


def degrees(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, cp=1) -> Degrees:
    return Degrees(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep, cp=cp)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (degrees(), {}),
        (degrees(dp_shard=2), {"dp_shard": 2}),
        (degrees(dp_replicate=2), {"dp_replicate": 2, "dp_shard": 1}),
        (degrees(dp_replicate=2, dp_shard=2), {"dp_replicate": 2, "dp_shard": 2}),
        (degrees(tp=2), {"tp": 2}),
        (degrees(dp_shard=2, tp=4), {"dp_shard": 2, "tp": 4}),
        (degrees(pp=2, dp_shard=2, tp=2), {"pp": 2, "dp_shard": 2, "tp": 2}),
    ],
)
def test_mesh_shape_skips_size_one_dims_but_keeps_a_shard_dim_for_ddp(layout, shape):
    assert mesh_shape(layout) == shape
    assert list(mesh_shape(layout)) == [d for d in ("pp", "dp_replicate", "dp_shard", "tp") if d in shape]


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (degrees(dp_shard=2, ep=2), {"dp_shard_mod_ep": 1, "ep": 2}),
        (degrees(dp_shard=8, ep=2), {"dp_shard_mod_ep": 4, "ep": 2}),
        (degrees(dp_replicate=2, dp_shard=4, ep=4), {"dp_replicate": 2, "dp_shard_mod_ep": 1, "ep": 4}),
    ],
)
def test_expert_parallel_splits_dp_shard_into_an_outer_fsdp_dim_and_ep(layout, shape):
    assert mesh_shape(layout) == shape
    assert list(mesh_shape(layout)) == list(shape)  # ep inside: the ranks exchanging tokens are neighbours


def meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(TransformerArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, ffn_dim=64))


def parallel_cfg(**overrides):
    return OmegaConf.merge(OmegaConf.structured(ParallelConfig), overrides)


def test_single_process_plan_wraps_blocks_for_checkpointing_only():
    model = meta_model()
    parallelize(model, None, degrees(), parallel_cfg(activation_checkpoint="full"), torch.device("cpu"))
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.layers.values())
    assert fsdp_mesh(None) is None


def test_pipeline_stages_keep_their_blocks_and_the_whole_model_names():
    from forge.parallel.pipeline import build_stage_module

    model = meta_model()
    first, last = build_stage_module(model, 0, 2), build_stage_module(model, 1, 2)
    assert list(first.layers) == ["0"] and first.norm is None and first.output is None
    assert list(last.layers) == ["1"] and last.tok_embeddings is None
    names = {n for n, _ in model.named_parameters()}
    split = [n for part in (first, last) for n, _ in part.named_parameters()]
    assert sorted(split) == sorted(names)


def test_fp8_without_torchao_names_the_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(RuntimeError, match="pip install torchao"):
        parallelize(meta_model(), None, degrees(), parallel_cfg(fp8=True), torch.device("cpu"))


def mesh_groups(layout: Degrees) -> dict:
    """On each forked rank: build the mesh with every warning an error, and return the ranks of this rank's
    data-parallel, FSDP and expert-FSDP groups (None where the layout has none)."""
    import warnings

    import torch.distributed as dist

    from forge.parallel.mesh import build_mesh, dp_mesh, expert_fsdp_mesh, token_mesh

    def ranks(sub) -> list[list[int]] | None:
        return None if sub is None else sub.mesh.reshape(-1, sub.mesh.shape[-1]).tolist()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh = build_mesh(layout, "cpu")
        groups = {"dp": ranks(dp_mesh(mesh)), "fsdp": ranks(fsdp_mesh(mesh))}
        if layout.ep > 1:
            groups["expert_fsdp"] = ranks(expert_fsdp_mesh(mesh))
        if layout.cp > 1:
            groups["tokens"] = ranks(token_mesh(mesh))
    groups["dp_size_seen"] = dist.get_world_size(dp_mesh(mesh).get_group())
    return groups


def row_major_groups(shape: dict[str, int], keep: tuple[str, ...], rank: int) -> list[list[int]]:
    """The ranks sharing `rank`'s coordinates outside `keep`, laid out over `keep` (independent of DeviceMesh)."""
    names = list(shape)
    strides = {name: int(torch.tensor([shape[n] for n in names[i + 1 :]]).prod()) for i, name in enumerate(names)}
    coords = {name: rank // strides[name] % shape[name] for name in names}
    base = sum(coords[n] * strides[n] for n in names if n not in keep)
    grid = torch.zeros(*[shape[n] for n in keep], dtype=torch.long) + base
    for axis, name in enumerate(keep):
        view = [1] * len(keep)
        view[axis] = shape[name]
        grid = grid + (torch.arange(shape[name]) * strides[name]).view(view)
    return grid.reshape(-1, grid.shape[-1]).tolist()


@pytest.mark.dist
@pytest.mark.parametrize(
    ("layout", "want"),
    [
        (
            degrees(dp_replicate=2, dp_shard=4),
            {"dp": ("dp_replicate", "dp_shard"), "fsdp": ("dp_replicate", "dp_shard")},
        ),
        (degrees(dp_shard=4, tp=2), {"dp": ("dp_shard",), "fsdp": ("dp_shard",)}),
        (
            degrees(dp_shard=8, ep=2),
            {"dp": ("dp_shard_mod_ep", "ep"), "fsdp": ("dp_shard_mod_ep", "ep"), "expert_fsdp": ("dp_shard_mod_ep",)},
        ),
        (
            degrees(dp_replicate=2, dp_shard=4, ep=2),
            {
                "dp": ("dp_replicate", "dp_shard_mod_ep", "ep"),
                "fsdp": ("dp_replicate", "dp_shard_mod_ep", "ep"),
                "expert_fsdp": ("dp_replicate", "dp_shard_mod_ep"),
            },
        ),
        (
            degrees(dp_replicate=2, dp_shard=2, cp=2),
            {
                "dp": ("dp_replicate", "dp_shard"),
                "fsdp": ("dp_replicate", "dp_shard", "cp"),
                "tokens": ("dp_replicate", "dp_shard", "cp"),
            },
        ),
        (
            degrees(dp_shard=2, cp=2, tp=2),
            {"dp": ("dp_shard",), "fsdp": ("dp_shard", "cp"), "tokens": ("dp_shard", "cp")},
        ),
    ],
)
def test_flattened_mesh_dims_are_kept_not_sliced_from_the_root(layout, want):
    """dp (and dp_shard under ep) are flattened dimensions: PyTorch deprecates slicing them out of the root mesh,
    so build_mesh keeps them. Each rank's groups must hold the ranks row-major layout arithmetic says."""
    from tests.parallel.harness import launch

    got = launch(mesh_groups, layout.world_size, layout)
    shape = mesh_shape(layout)
    for rank, groups in enumerate(got):
        for name, dims in want.items():
            flat = sum(row_major_groups(shape, dims, rank), [])
            # dp and the token ranks are 1-D; FSDP and expert FSDP meshes are 2-D (dp_replicate, shard) under HSDP.
            rows = layout.dp_replicate if name not in ("dp", "tokens") and layout.dp_replicate > 1 else 1
            expected = torch.tensor(flat).reshape(rows, -1).tolist()
            assert groups[name] == expected, (rank, name)
        assert groups["dp_size_seen"] == layout.dp


def sharded_result_mesh(layout: Degrees) -> dict:
    """Build the run's mesh, compute on a tensor sharded over it, and report whether the result's mesh is this
    mesh and its groups resolve (an all-reduce over each dimension)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from forge.parallel.mesh import build_mesh

    mesh = build_mesh(layout, "cpu")
    result = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)]) * 2
    for dim in range(result.device_mesh.ndim):
        dist.all_reduce(torch.ones(1), group=result.device_mesh.get_group(dim))
    return {"same_mesh": result.device_mesh is mesh}


@pytest.mark.dist
def test_a_mesh_equal_to_one_of_an_earlier_process_group_gets_results_on_itself():
    """DTensor caches sharding results with the mesh they were computed on, and meshes compare equal without their
    process groups: a run after a simulated world of the same shape in the forking process (as --plan makes) once
    failed with "Could not resolve the process group registered under the name 3". build_mesh drops the caches."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from forge.parallel.mesh import build_mesh, forget_earlier_meshes
    from tests.parallel.harness import launch

    layout = degrees(pp=2, dp_shard=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        simulated = build_mesh(layout, "cpu")
        distribute_tensor(torch.ones(4, 4), simulated, [Shard(0), Shard(1)]) * 2  # cached on the simulated mesh
    finally:
        dist.destroy_process_group()
    try:
        assert launch(sharded_result_mesh, 4, layout) == [{"same_mesh": True}] * 4
    finally:
        forget_earlier_meshes()  # the simulated mesh stays out of this process's later tests
