"""Pipeline stages read and write checkpoints under the whole model's names (one process, no pipeline run)."""

import pytest
import torch.distributed.checkpoint as dcp
from torch import nn

import forge.config  # noqa: F401 - imported before forge.parallel, whose modules import each other through it
from forge.checkpoint import CheckpointError
from forge.checkpoint.compat import check_model_keys
from forge.checkpoint.stages import rename, whole_model_keys, whole_model_names
from forge.models.llama.args import TransformerArgs
from forge.models.llama.transformer import build_transformer
from forge.parallel.pipeline import build_stage_module


def tiny(n_layers: int):
    return build_transformer(TransformerArgs(dim=32, n_layers=n_layers, n_heads=4, vocab_size=64, ffn_dim=48))


def saved(path, model) -> None:
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)


def test_a_stage_accepts_the_other_stages_keys_but_not_foreign_ones(tmp_path):
    whole = tiny(4)
    saved(tmp_path / "four", whole)
    stage = build_stage_module(whole, 1, 2)  # blocks 2 and 3, the norm and the head
    assert whole_model_keys(whole) is None
    assert whole_model_keys(stage) == set(whole.state_dict())
    with pytest.raises(CheckpointError, match="has model key 'layers.0"):
        check_model_keys(tmp_path / "four", stage.state_dict())  # the stage alone: other stages' keys look foreign
    check_model_keys(tmp_path / "four", stage.state_dict(), whole_keys=whole_model_keys(stage))
    saved(tmp_path / "six", tiny(6))
    with pytest.raises(CheckpointError, match="has model key 'layers.4"):
        check_model_keys(tmp_path / "six", stage.state_dict(), whole_keys=whole_model_keys(stage))


def test_two_stages_of_a_rank_are_named_as_in_the_whole_model():
    whole = tiny(4)
    stages = nn.ModuleList([build_stage_module(whole, s, 4) for s in (0, 2)])  # interleaved 1F1B, rank 0
    model_sd, optim_sd = stages.state_dict(), {"state": {}, "param_groups": [{"params": list(stages.state_dict())}]}
    names = whole_model_names(stages, model_sd)
    renamed, renamed_optim = rename(model_sd, optim_sd, names)
    held = ("tok_embeddings.", "layers.0.", "layers.2.")
    assert set(renamed) == {key for key in whole.state_dict() if key.startswith(held)}
    assert renamed_optim["param_groups"][0]["params"] == list(renamed)
    back, _ = rename(renamed, None, {v: k for k, v in names.items()})
    assert list(back) == list(model_sd) and all(back[k] is model_sd[k] for k in back)
