"""Each strategy trains with falling loss; resume is exact across a freeze-schedule change; 2-rank FSDP matches
one process."""

import json

import pytest

from forge.checkpoint import CheckpointError
from forge.config import compose
from forge.train.vlm_trainer import VLMTrainer
from tests.parallel.harness import launch
from tests.tiny import Crash, CrashAfterSteps
from tests.vlm.scenarios import TINY, VQA, losses, train


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["joint_decoder", "cross_attention", "mot", "moma"])
def test_each_strategy_learns_the_embedded_vqa(strategy, tmp_path):
    """(The command line of a VLM run is the README's `forge-train vlm=cross_attention data=vqa_embedded`.)"""
    summary = train(str(tmp_path), f"vlm={strategy}", "train.steps=20", "train.threads=0")
    assert summary["final_val_loss"] < summary["first_val_loss"] - 2.0, summary
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 21))
    assert all(r["media_skipped"] == 0 for r in logged)  # every sample's image decoded


@pytest.mark.slow
def test_video_clips_train(tmp_path):
    overrides = [
        "data=video_embedded",
        "vlm=joint_decoder",
        "vlm.connector=avgpool",
        "vlm.connector_tokens=2",
        "vlm.time_embedding=true",
        "data.stride_seconds=1.0",
        "data.max_frames=4",
        "train.steps=20",
        "train.threads=0",
    ]
    summary = train(str(tmp_path), *overrides)
    assert summary["final_val_loss"] < summary["first_val_loss"] - 2.0, summary


class CrashingVLMTrainer(CrashAfterSteps, VLMTrainer):
    crash_after = 5


SCHEDULE = ["vlm=joint_decoder", "train.steps=8", "vlm.train_decoder_from_step=2", "vlm.train_encoder_from_step=4"]


def test_resume_across_a_freeze_change_is_bitwise_and_the_schedule_is_checked(tmp_path):
    whole = train(str(tmp_path / "whole"), *SCHEDULE)
    overrides = [*VQA, *TINY, *SCHEDULE, "checkpoint.interval=3"]
    with pytest.raises(Crash):
        CrashingVLMTrainer(compose(overrides), tmp_path / "cut").fit()
    VLMTrainer(compose(overrides), tmp_path / "cut").fit()  # resumes at step 3: decoder trained, encoder not yet
    assert losses(tmp_path / "cut") == whole["losses"]
    changed = [*overrides, "vlm.train_encoder_from_step=20"]
    with pytest.raises(CheckpointError, match=r"vlm.train_encoder_from_step=20 \(was 4\)"):  # the config check
        VLMTrainer(compose(changed), tmp_path / "cut")
    with pytest.raises(ValueError, match="vlm.train_encoder_from_step=20"):  # and the model's own, past it
        VLMTrainer(compose([*changed, "checkpoint.check_resume_config=false"]), tmp_path / "cut")


@pytest.mark.slow
def test_two_rank_fsdp_matches_one_process(tmp_path):
    # The trainer's loss is the mean of micro-batch means (answer tokens per sample vary), so the one-process
    # reference accumulates the same two micro-batches of 4 that the two ranks take. MoT, with activation
    # checkpointing on the two ranks: its FSDP units (projections, FFNs) are unsharded again when a layer is
    # recomputed in backward.
    run = ["vlm=mot", "train.steps=4", "vlm.train_encoder_from_step=2", "train.micro_batch_size=4"]
    single = train(str(tmp_path / "one"), *run)
    two = launch(train, 2, str(tmp_path / "two"), *run, "parallel=fsdp", "parallel.activation_checkpoint=full")
    assert sorted(two[0]["losses"]) == [1, 2, 3, 4]
    assert two[0]["sharded"] == {"decoder": True, "encoder": True}  # the schedule trains the tower: sharded too
    assert single["sharded"] == {"decoder": False, "encoder": False}
    for step, loss in single["losses"].items():
        assert two[0]["losses"][step] == pytest.approx(loss, rel=1e-5), step


def train_recording_gathers(run_dir: str, *overrides: str) -> dict:
    """`train`, plus the dtype of a decoder weight as its block's forward sees it (FSDP's gathered copy)."""
    from pathlib import Path

    from torch.distributed.fsdp import FSDPModule

    from tests.tiny import losses as read_losses
    from tests.vlm.scenarios import TINY as VLM_TINY

    trainer = VLMTrainer(compose([*VQA, *VLM_TINY, *overrides]), Path(run_dir))
    seen: set[str] = set()
    wq = trainer.model.decoder.layers["0"].attention.wq
    wq.register_forward_pre_hook(lambda module, args: seen.add(str(module.weight.dtype)))
    root = trainer.model
    policy = root._get_fsdp_state()._mp_policy if isinstance(root, FSDPModule) else None
    trainer.fit()
    return {
        "gathered": sorted(seen),
        "cast_inputs": None if policy is None else policy.cast_forward_inputs,
        "losses": read_losses(run_dir),
    }


@pytest.mark.slow
def test_two_rank_bf16_fsdp_gathers_bf16_and_follows_one_process(tmp_path):
    """FSDP of a VLM follows train.dtype as the text plan does: bf16 gathers (half the bytes of fp32), fp32
    master weights; one process computes on a bf16 copy of its fp32 weights (forge.train.compute_weights), and
    the losses of the two follow each other within bf16's rounding."""
    run = ["vlm=joint_decoder", "train.steps=3", "train.dtype=bf16", "train.micro_batch_size=4"]
    one = train_recording_gathers(str(tmp_path / "one"), *run)
    two = launch(train_recording_gathers, 2, str(tmp_path / "two"), *run, "parallel=fsdp")[0]
    assert one["gathered"] == ["torch.bfloat16"] and two["gathered"] == ["torch.bfloat16"]
    assert two["cast_inputs"] is False  # the root leaves the pixels to the (frozen, unsharded) tower
    assert sorted(two["losses"]) == [1, 2, 3]
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, rel=2**-6), step


def initial_weights(run_dir: str, *overrides: str) -> dict:
    """The trainer's model right after it was built: every tensor whole (by digest), and how many decoder
    elements this rank holds."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from tests.parallel.test_init import digest

    trainer = VLMTrainer(compose([*VQA, *TINY, "train.micro_batch_size=4", *overrides]), Path(run_dir))
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    decoder = list(trainer.model.decoder.parameters())
    return {
        "weights": {name: digest(tensor) for name, tensor in state.items()},
        "decoder_held": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in decoder),
        "decoder_whole": sum(p.numel() for p in decoder),
    }


@pytest.mark.parametrize(
    "strategy",
    [
        ["vlm=joint_decoder", "vlm.connector=attnpool", "vlm.connector_tokens=2"],  # tower frozen: not FSDP's
        ["vlm=cross_attention", "vlm.train_encoder_from_step=2"],  # tower trained: sharded too
        ["vlm=mot"],
        ["vlm=moma"],
    ],
    ids=lambda overrides: overrides[0],
)
def test_two_fsdp_ranks_start_from_the_one_process_weights_each_filling_only_its_shards(strategy, tmp_path):
    """Built on the meta device but for the loaded tower, each rank fills its shards from (seed, name, row block):
    bit for bit the weights one process starts from, and no rank ever holds the whole decoder."""
    one = initial_weights(str(tmp_path / "one"), *strategy)
    ranks = launch(initial_weights, 2, str(tmp_path / "two"), *strategy, "parallel=fsdp")
    assert one["decoder_held"] == one["decoder_whole"]
    for rank in ranks:
        assert rank["weights"] == one["weights"]
        assert rank["decoder_held"] <= one["decoder_whole"] / 2 + 1024  # FSDP pads each shard by under a row
