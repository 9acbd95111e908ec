"""A run saved before a schema gained an option resumes: the missing key counts as its default."""

from omegaconf import OmegaConf

from forge.checkpoint.resume_check import config_changes
from forge.config import compose


def saved_without(cfg, group: str, key: str):
    """The run's config as an older forge wrote it: a plain mapping (as config.yaml loads) lacking group.key."""
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    del plain[group][key]
    return plain


def test_a_key_added_since_the_checkpoint_counts_as_its_default():
    current = compose([])
    for key in ("head_dim", "attention", "sliding_window"):
        assert config_changes(saved_without(current, "model", key), current) == [], key
    assert config_changes(saved_without(current, "checkpoint", "save_hf"), current) == []


def test_a_new_key_set_to_something_else_is_still_a_change():
    current = compose(["model.head_dim=16"])
    changes = config_changes(saved_without(current, "model", "head_dim"), current)
    assert [(c.key, c.kind) for c in changes] == [("model.head_dim", "refused")]


def test_a_nested_key_added_since_the_checkpoint_counts_as_its_default():
    current = compose(["model=moe_tiny"])
    plain = OmegaConf.create(OmegaConf.to_container(current, resolve=True))
    del plain["model"]["moe"]["first_dense"]  # model.moe.first_dense came after MoE checkpoints existed
    assert config_changes(plain, current) == []
    plain.model.moe.first_dense = 1
    assert [c.key for c in config_changes(plain, current)] == ["model.moe.first_dense"]
