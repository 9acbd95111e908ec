"""Validation asks a config node what it is through its schema type (OmegaConf.get_type), not its `_target_`: every
option of conf/data and conf/optimizer keeps its schema's type after command-line overrides, and the optimizer
schema says whether its target takes the model or param groups."""

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from forge.config import compose, conf_dir, validate
from forge.config.schema import SCHEMAS, MemmapDataConfig, MuonOptimizerConfig, OptimizerConfig, VLMDataConfig
from forge.config.validate import composed_from
from forge.models.llama.transformer import build_transformer
from forge.train import build
from tests.tiny import TINY_MODEL


def declared_schema(path) -> type:
    """The schema an option extends (`- /<name>@_here_` in its defaults list)."""
    raw = yaml.safe_load(path.read_text())
    names = [e.lstrip("/").split("@")[0] for e in raw["defaults"] if isinstance(e, str) and e.endswith("@_here_")]
    return SCHEMAS[names[0]]


DATA = sorted((conf_dir() / "data").glob("*.yaml"))


@pytest.mark.parametrize("path", DATA, ids=[p.stem for p in DATA])
@pytest.mark.parametrize("overrides", [[], ["data.vocab_size=1000"], ["data._target_=somewhere.else"]])
def test_every_data_option_is_its_schemas_type_after_overrides(path, overrides):
    cfg = compose([f"data={path.stem}", *overrides])
    assert OmegaConf.get_type(cfg.data) is declared_schema(path)
    assert composed_from(cfg.data, VLMDataConfig) == (
        path.stem in {"vqa_embedded", "video_embedded", "image_text", "photos_embedded"}
    )


def test_a_memmap_config_stays_one_when_validation_fills_its_vocab_size(tmp_path):
    (tmp_path / "meta.json").write_text('{"vocab_size": 300}')
    cfg = compose(["data=memmap", f"data.path={tmp_path}"])
    validate(cfg, 1)
    assert cfg.data.vocab_size == 300 and OmegaConf.get_type(cfg.data) is MemmapDataConfig


OPTIMIZERS = sorted((conf_dir() / "optimizer").glob("*.yaml"))


@pytest.mark.parametrize("path", OPTIMIZERS, ids=[p.stem for p in OPTIMIZERS])
def test_only_muon_builds_from_the_model(path):
    cfg = compose([f"optimizer={path.stem}", "optimizer.lr=1e-3"])
    schema = OmegaConf.get_type(cfg.optimizer)
    assert schema is declared_schema(path)
    assert getattr(schema, "takes_model", False) == (schema is MuonOptimizerConfig)


def test_adamw_is_the_default_target_and_gets_param_groups():
    cfg = compose(TINY_MODEL)
    assert OmegaConf.get_type(cfg.optimizer) is OptimizerConfig and cfg.optimizer._target_ == "torch.optim.AdamW"
    optimizer, _ = build.build_optimizer(cfg, build_transformer(build.model_args(cfg)))
    assert type(optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.optimizer.weight_decay, 0.0]
