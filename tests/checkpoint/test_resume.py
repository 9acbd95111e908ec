"""Save, seal, retain and resume in one process: a resumed run reproduces the uninterrupted one bit for bit."""

import json
import math
import shutil

import pytest
import torch

from forge.checkpoint import CheckpointError
from forge.config import compose
from forge.train.trainer import Trainer
from tests.tiny import TINY_MODEL, Crash, CrashingTrainer, losses

TINY = [
    *TINY_MODEL,
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.dtype=fp32",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "scheduler.warmup_steps=3",
    "train.steps=12",
]


class CrashingOnceSaved(CrashingTrainer):
    """Dies as CrashingTrainer does, once the save in flight is written and sealed: an async write still running
    when the process dies leaves the checkpoint before it as the latest, by design, and on a loaded machine the
    write thread can lag the 3 steps that follow it."""

    def train_step(self, step: int):
        if self.crash_after == 0:
            self.checkpointer.wait()
        return super().train_step(step)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_is_bitwise_exact(tmp_path, mode):
    Trainer(compose(TINY), tmp_path / "whole").fit()
    overrides = [*TINY, "checkpoint.interval=4", f"checkpoint.async_mode={mode}"]
    with pytest.raises(Crash):
        CrashingOnceSaved(compose(overrides), tmp_path / "cut").fit()
    assert (tmp_path / "cut/checkpoints/latest").read_text().strip() == "step-00000004"
    resumed = Trainer(compose(overrides), tmp_path / "cut")
    assert resumed.state.step == 4
    resumed.fit()
    whole, cut = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert sorted(cut) == list(range(1, 13))
    assert [cut[s] for s in range(1, 13)] == [whole[s] for s in range(1, 13)]


def test_retention_keeps_last_n_and_milestones(tmp_path):
    cfg = compose([*TINY, "checkpoint.interval=2", "checkpoint.keep_last_n=2", "checkpoint.milestones=[4]"])
    Trainer(cfg, tmp_path).fit()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step-00000004", "step-00000010", "step-00000012"]
    assert (tmp_path / "checkpoints/latest").read_text().strip() == "step-00000012"
    saved = tmp_path / "checkpoints/step-00000012"
    assert (saved / "COMPLETE").is_file() and (saved / "config.yaml").is_file()
    assert "dim: 64" in (saved / "config.yaml").read_text()


def test_interval_zero_saves_nothing(tmp_path):
    Trainer(compose(TINY), tmp_path).fit()
    assert not (tmp_path / "checkpoints").exists()


def test_incomplete_checkpoint_is_never_loaded(tmp_path):
    Trainer(compose([*TINY, "checkpoint.interval=4"]), tmp_path).fit()
    root = tmp_path / "checkpoints"
    # a half-written newer checkpoint: files but no COMPLETE marker, and a stale pointer to it
    shutil.copytree(root / "step-00000012", root / "step-00000016")
    (root / "step-00000016/COMPLETE").unlink()
    (root / "latest").write_text("step-00000016\n")
    trainer = Trainer(compose([*TINY, "checkpoint.interval=4", "train.steps=16"]), tmp_path)
    assert trainer.state.step == 12
    with pytest.raises(CheckpointError, match="incomplete"):
        Trainer(compose([*TINY, f"checkpoint.resume={root / 'step-00000016'}"]), tmp_path / "other")


def test_mismatching_checkpoint_names_the_key(tmp_path):
    """Past the config check (or for a checkpoint without config.yaml), DCP's keys and shapes name the mismatch."""
    Trainer(compose([*TINY, "checkpoint.interval=12"]), tmp_path / "a").fit()
    with pytest.raises(CheckpointError, match=r"model.ffn_dim=96 \(was 128\)"):
        Trainer(compose([*TINY, "model.ffn_dim=96", f"checkpoint.resume={tmp_path / 'a'}"]), tmp_path / "b")
    unchecked = [*TINY, "checkpoint.check_resume_config=false"]
    wider = [*unchecked, "model.ffn_dim=96", f"checkpoint.resume={tmp_path / 'a'}"]
    with pytest.raises(CheckpointError, match=r"layers.0.feed_forward.w1.weight' has shape \(128, 64\)"):
        Trainer(compose(wider), tmp_path / "b")
    deeper = [*unchecked, "model.n_layers=3", f"checkpoint.resume={tmp_path / 'a'}"]
    with pytest.raises(CheckpointError, match="lacks model key 'layers.2"):
        Trainer(compose(deeper), tmp_path / "c")
    shallower = [*unchecked, "model.n_layers=1", f"checkpoint.resume={tmp_path / 'a'}"]
    with pytest.raises(CheckpointError, match="has model key 'layers.1"):
        Trainer(compose(shallower), tmp_path / "d")


def test_resume_refuses_another_model_data_batch_seq_len_seed_or_optimizer_naming_each_key(tmp_path):
    Trainer(compose([*TINY, "checkpoint.interval=4", "train.steps=4"]), tmp_path / "a").fit()
    saved = tmp_path / "a/checkpoints/step-00000004"
    changes = {
        "train.global_batch_size=8": r"train.global_batch_size=8 \(was 4\)",
        "train.seq_len=16": r"train.seq_len=16 \(was 32\)",
        "train.seed=7": r"train.seed=7 \(was 1234\)",
        "optimizer=lion": r"optimizer._target_=forge.train.optimizers.lion.Lion",
        "model.rope_theta=5000": r"model.rope_theta=5000.0 \(was 10000.0\)",  # same shapes: DCP would load it
        "data.val_every=10": r"data.val_every=10 \(was 20\)",  # another train/val split of the same text
    }
    for override, message in changes.items():
        with pytest.raises(CheckpointError, match=message) as err:
            Trainer(compose([*TINY, override, f"checkpoint.resume={saved}"]), tmp_path / "b")
        assert f"checkpoint.resume=none checkpoint.load_weights={saved}" in str(err.value)
    anyway = [*TINY, "train.seed=7", "checkpoint.check_resume_config=false", f"checkpoint.resume={saved}"]
    with pytest.raises(ValueError, match="loader state was saved with seed 1234"):  # the loader's own check remains
        Trainer(compose(anyway), tmp_path / "b")
    # What may change: the length of the run, the micro batch, the layout.
    resumed = Trainer(
        compose([*TINY, "train.steps=6", "train.micro_batch_size=1", f"checkpoint.resume={saved}"]), tmp_path / "c"
    )
    assert resumed.state.step == 4


def test_corrupt_or_missing_files_are_named(tmp_path):
    Trainer(compose([*TINY, "checkpoint.interval=6"]), tmp_path / "a").fit()
    ckpt = tmp_path / "a/checkpoints/step-00000012"
    data = next(ckpt.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot load checkpoint") as err:
        Trainer(compose([*TINY, "checkpoint.interval=6"]), tmp_path / "a")  # resume=auto: the latest, cut
    assert "rank 0: " in str(err.value) and "Traceback" not in str(err.value) and "\n" not in str(err.value)
    before = tmp_path / "a/checkpoints/step-00000006"
    assert str(err.value).endswith(
        f"the checkpoint before it is complete and untouched: checkpoint.resume={before} resumes from it"
    )
    assert Trainer(compose([*TINY, f"checkpoint.resume={before}"]), tmp_path / "a").state.step == 6
    (ckpt / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=".metadata"):
        Trainer(compose([*TINY, f"checkpoint.resume={ckpt}"]), tmp_path / "c")
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer(compose([*TINY, f"checkpoint.resume={tmp_path / 'nowhere'}"]), tmp_path / "d")


def test_warm_start_loads_weights_only(tmp_path):
    Trainer(compose([*TINY, "checkpoint.interval=12"]), tmp_path / "a").fit()
    source = Trainer(compose([*TINY, "checkpoint.resume=none"]), tmp_path / "x")
    warm = Trainer(
        compose([*TINY, f"checkpoint.load_weights={tmp_path / 'a'}", "checkpoint.load_weights_exclude=[output.]"]),
        tmp_path / "b",
    )
    trained = Trainer(compose([*TINY, f"checkpoint.resume={tmp_path / 'a'}"]), tmp_path / "c")
    assert warm.state.step == 0
    assert torch.equal(warm.model.layers["0"].attention.wq.weight, trained.model.layers["0"].attention.wq.weight)
    assert not torch.equal(warm.model.layers["0"].attention.wq.weight, source.model.layers["0"].attention.wq.weight)
    assert torch.equal(warm.model.output.weight, source.model.output.weight)
    assert not warm.optimizer.state
    typo = [*TINY, f"checkpoint.load_weights={tmp_path / 'a'}", "checkpoint.load_weights_exclude=[outptu.]"]
    with pytest.raises(CheckpointError, match="load_weights_exclude has 'outptu.', which starts no parameter name"):
        Trainer(compose(typo), tmp_path / "d")


def test_a_resume_at_or_past_train_steps_says_there_is_nothing_to_train(tmp_path, caplog):
    Trainer(compose([*TINY, "checkpoint.interval=4", "train.steps=4"]), tmp_path / "a").fit()
    with caplog.at_level("WARNING", logger="forge"):
        summary = Trainer(compose([*TINY, "train.steps=3", "checkpoint.resume=auto"]), tmp_path / "a").fit()
    assert summary["steps"] == 4 and math.isnan(summary["final_loss"])
    assert "resumed at step 4, which is not before train.steps=3: nothing to train" in caplog.text


def test_an_unwritable_checkpoint_dir_is_named_before_the_model_is_built(tmp_path, monkeypatch, caplog):
    import forge.train.trainer as trainer_module

    built = []
    monkeypatch.setattr(Trainer, "build_model_and_data", lambda self: built.append(1) or None)
    bad = [*TINY, "checkpoint.interval=4", "checkpoint.dir=/proc/forge-checkpoints"]
    with pytest.raises(CheckpointError, match="checkpoint.dir=/proc/forge-checkpoints: cannot write checkpoints"):
        Trainer(compose(bad), tmp_path / "a")
    assert not built
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="forge"):
        tolerant = trainer_module.Trainer(compose([*bad, "checkpoint.on_save_error=continue"]), tmp_path / "b")
    assert "training anyway" in caplog.text and tolerant.state.step == 0


def test_a_fresh_run_never_deletes_another_runs_checkpoints(tmp_path):
    from forge.checkpoint.layout import complete_checkpoints, latest_checkpoint

    Trainer(compose([*TINY, "train.steps=4", "checkpoint.interval=2"]), tmp_path).fit()
    old = [p.name for p in complete_checkpoints(tmp_path / "checkpoints")]
    assert old == ["step-00000002", "step-00000004"]
    fresh = [*TINY, "train.steps=3", "checkpoint.interval=3", "checkpoint.keep_last_n=1", "checkpoint.resume=none"]
    with pytest.raises(CheckpointError, match="checkpoint.overwrite=true") as err:
        Trainer(compose(fresh), tmp_path)
    assert "2 checkpoint(s) of another run" in str(err.value)
    Trainer(compose([*fresh, "checkpoint.overwrite=true"]), tmp_path).fit()
    kept = [p.name for p in complete_checkpoints(tmp_path / "checkpoints")]
    assert kept == ["step-00000002", "step-00000003", "step-00000004"]  # keep_last_n=1 pruned none of the old run's
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-00000003"  # the new run's, where `latest` points


def lrs(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


def test_resume_applies_a_new_lr_weight_decay_and_schedule_length(tmp_path):
    """The optimizer state and the scheduler's state bring the old run's lr and weight decay back; a resume must use
    the new ones, and the schedule of the new length from the resumed step on."""
    Trainer(compose([*TINY, "checkpoint.interval=4", "train.steps=4"]), tmp_path).fit()
    new = [*TINY, "checkpoint.interval=4", "train.steps=10", "optimizer.lr=1e-3", "optimizer.weight_decay=0.05"]
    resumed = Trainer(compose(new), tmp_path)
    assert resumed.state.step == 4
    decay, no_decay = resumed.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    resumed.fit()
    # warmup_cosine computed here on its own: 3 warmup steps, then cosine from 1e-3 to 1e-4 at step 10
    for step, lr in lrs(tmp_path).items():
        if step <= 4:
            continue
        progress = (step - 1 - 3) / (10 - 3)
        expected = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert lr == pytest.approx(expected, rel=1e-12), step


def test_a_new_lr_keeps_schedule_free_s_step_count_and_weight_sum(tmp_path):
    """Schedule-free keeps training state in its param groups (k, weight_sum, lr_max): a new lr must not reset it."""
    run = [*TINY, "optimizer=schedule_free_adamw", "scheduler=constant", "checkpoint.interval=4", "train.steps=4"]
    first = Trainer(compose(run), tmp_path)
    first.fit()
    saved = dict(first.optimizer.param_groups[0])
    resumed = Trainer(compose([*run, "train.steps=6", "optimizer.lr=1e-3"]), tmp_path)
    group = resumed.optimizer.param_groups[0]
    assert group["k"] == saved["k"] == 4
    assert (group["weight_sum"], group["lr_max"]) == (saved["weight_sum"], saved["lr_max"])
    assert group["initial_lr"] == 1e-3 and group["lr"] == pytest.approx(1e-3, rel=1e-12)
