"""conf/loss trains a VLM as it trains text: chunked cross-entropy follows the plain run, and the z-loss run's loss
is cross-entropy plus z_loss_weight * mean(logsumexp^2), computed here by hand on its first batch."""

import pytest
import torch

from forge.config import compose
from forge.train.vlm_trainer import VLMTrainer
from tests.parallel.harness import launch
from tests.vlm.scenarios import TINY, VQA, train

RUN = ["vlm=joint_decoder", "train.steps=4"]
Z_WEIGHT = 1e-2


def test_chunked_cross_entropy_trains_a_vlm_as_plain_cross_entropy_does(tmp_path):
    plain = train(str(tmp_path / "plain"), *RUN)
    chunked = train(str(tmp_path / "chunked"), *RUN, "loss=chunked_cross_entropy", "loss.chunk_size=5")
    assert sorted(chunked["losses"]) == [1, 2, 3, 4]
    assert list(chunked["losses"].values()) == pytest.approx(list(plain["losses"].values()), rel=1e-5)
    assert chunked["final_val_loss"] == pytest.approx(plain["final_val_loss"], rel=1e-5)
    assert plain["losses"][4] < plain["losses"][1]


@pytest.mark.dist
def test_chunked_cross_entropy_under_two_rank_fsdp_follows_one_plain_process(tmp_path):
    # The head is the FSDP root's: gathered from the forward through the chunked loss's backward.
    run = ["vlm=joint_decoder", "train.steps=3", "train.micro_batch_size=4"]
    one = train(str(tmp_path / "one"), *run)
    chunked = ["loss=chunked_cross_entropy", "loss.chunk_size=7"]
    two = launch(train, 2, str(tmp_path / "two"), *run, *chunked, "parallel=fsdp")[0]
    assert two["sharded"]["decoder"]
    assert list(two["losses"].values()) == pytest.approx(list(one["losses"].values()), rel=1e-5)


def by_hand(trainer: VLMTrainer, batch: dict) -> tuple[float, float]:
    """(cross-entropy, mean logsumexp^2) over the labelled tokens of one batch, in float64 from the model's logits."""
    with torch.no_grad():
        logits = trainer.model(batch["tokens"], batch["pixels"], batch["frame_mask"], batch["frame_times"])
    flat, labels = logits.double().flatten(0, 1), batch["labels"].flatten()
    keep = labels != -100
    log_z = torch.log(torch.exp(flat).sum(dim=1))[keep]
    nll = log_z - flat[keep, labels[keep]]
    return nll.mean().item(), log_z.square().mean().item()


def test_z_loss_of_a_vlm_is_cross_entropy_plus_its_weighted_mean_squared_log_partition(tmp_path):
    z_run = [*RUN, "loss=z_loss", f"loss.z_loss_weight={Z_WEIGHT}"]
    fresh = VLMTrainer(compose([*VQA, *TINY, *z_run]), tmp_path / "fresh")  # the run's initial weights, 1st batch
    nll, z = by_hand(fresh, fresh.loader.next_batch())
    assert z > 1.0  # log Z ~ log(vocab) at initialisation: the term is far from negligible
    run = train(str(tmp_path / "z"), *z_run)
    assert run["losses"][1] == pytest.approx(nll + Z_WEIGHT * z, rel=1e-5)
    plain = train(str(tmp_path / "plain"), *RUN)
    assert plain["losses"][1] == pytest.approx(nll, rel=1e-5)
    assert run["losses"][4] < run["losses"][1]
