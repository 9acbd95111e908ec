"""`parallelize` returns what it applied, and `forge-train --plan` prints those records, not the log."""

import logging

import pytest
import torch
from omegaconf import OmegaConf

from forge.config import compose
from forge.config.degrees import Degrees
from forge.config.schema import ParallelConfig
from forge.models.llama import Transformer, TransformerArgs
from forge.parallel.plan import parallelize
from forge.planning.report import plan_report


def test_single_process_plan_returns_its_steps_in_order():
    with torch.device("meta"):
        model = Transformer(TransformerArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, ffn_dim=64))
    parallel = OmegaConf.merge(OmegaConf.structured(ParallelConfig), {"activation_checkpoint": "full", "compile": True})
    applied = parallelize(model, None, Degrees(1, 1, 1, 1, 1), parallel, torch.device("cpu"))
    assert [a.step for a in applied] == ["activation_checkpoint", "compile"]
    assert applied[0].detail == "activation checkpointing (full) of 2 blocks" and applied[0].mesh == {}


@pytest.fixture
def forge_log_disabled():
    forge_log = logging.getLogger("forge")
    forge_log.disabled = True
    yield
    forge_log.disabled = False


def test_report_lists_the_transforms_with_the_log_disabled(forge_log_disabled):
    text = plan_report(compose(["model=llama_tiny", "parallel=fsdp", "parallel.world_size=2"]))
    assert "  1. FSDP over mesh {'dp_shard': 2}: 4 blocks and the root" in text
