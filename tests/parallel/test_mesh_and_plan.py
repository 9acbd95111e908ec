"""The mesh shape of each layout and the plan's single-process behaviour (no process group needed)."""

import sys

import pytest
import torch
from omegaconf import OmegaConf

from forge.config.schema import ParallelConfig
from forge.model import Transformer, TransformerArgs
from forge.parallel.degrees import Degrees
from forge.parallel.mesh import mesh_shape
from forge.parallel.plan import fsdp_mesh, parallelize


def degrees(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1) -> Degrees:
    return Degrees(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep)


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
