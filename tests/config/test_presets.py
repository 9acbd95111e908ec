"""Every preset in conf/ composes and passes validation."""

from pathlib import Path

import pytest

from forge.config import compose, conf_dir, validate

CONF = conf_dir()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def world_size_for(parallel) -> int:
    fixed = 1
    for key in ("dp_replicate", "dp_shard", "tp", "pp"):
        fixed *= max(1, parallel[key])
    has_free = any(parallel[k] == -1 for k in ("dp_replicate", "dp_shard", "tp", "pp"))
    return fixed * 2 if has_free else fixed


def test_conf_dir_is_the_checkout_tree():
    assert Path(__file__).resolve().parents[2] / "conf" == CONF


@pytest.mark.parametrize("model", options("model"))
def test_model_presets(model):
    cfg = compose([f"model={model}"])
    validate(cfg, world_size=1)


@pytest.mark.parametrize("parallel", options("parallel"))
def test_parallel_presets(parallel):
    model = "moe_tiny" if parallel.startswith("ep") else "llama_tiny"
    cfg = compose([f"parallel={parallel}", f"model={model}", "train.micro_batch_size=4", "train.global_batch_size=16"])
    degrees = validate(cfg, world_size=world_size_for(cfg.parallel))
    assert degrees.world_size == world_size_for(cfg.parallel)


# Options that describe the user's own files leave those keys mandatory (???); fill them as a user would.
REQUIRED = {
    "memmap": ["data.path=/data/shards", "data.vocab_size=50257"],
    "hf": ["data.dataset=/data/corpus.jsonl", "data.vocab_size=50257"],
    "vqa_embedded": ["vlm=joint_decoder"],
    "video_embedded": ["vlm=joint_decoder"],
    "photos_embedded": ["vlm=joint_decoder"],
    "image_text": ["vlm=joint_decoder", "data.path=/data/captions.jsonl"],
    "mixture": ["data.vocab_size=50257", "data.sources.web.path=/data/web", "data.sources.books.path=/data/books"],
}


@pytest.mark.parametrize(
    "group", ["data", "optimizer", "loss", "scheduler", "train", "checkpoint", "metrics", "resilience"]
)
def test_other_group_presets(group):
    for option in options(group):
        cfg = compose([f"{group}={option}", *REQUIRED.get(option, [])])
        validate(cfg, world_size=1)


def test_vlm_presets():
    assert options("vlm") == ["cross_attention", "joint_decoder", "moma", "mot"]
    for option in options("vlm"):
        for data in ("vqa_embedded", "video_embedded"):
            validate(compose([f"vlm={option}", f"data={data}"]), world_size=1)


def test_big_models_validate_on_their_cluster_layouts():
    cfg = compose(
        [
            "model=llama3_70b",
            "parallel=tp4_fsdp",
            "train.seq_len=8192",
            "train.global_batch_size=256",
            "train.micro_batch_size=1",
        ]
    )
    degrees = validate(cfg, world_size=256)
    assert (degrees.tp, degrees.dp_shard) == (4, 64)
