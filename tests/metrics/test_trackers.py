"""TensorBoard, W&B (offline) and MLflow (local file store) written by MetricsLogger and read back for real."""

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from forge.config import compose, validate
from forge.metrics import MetricsLogger
from tests.metrics.wandb_records import history, run_ids

os.environ.setdefault("WANDB_SILENT", "true")


def train_metrics(step: int) -> dict:
    return {"loss": 10.0 / step, "lr": 1e-3 * step, "grad_norm": 1.0, "tokens_per_s": 100.0 * step, "step_time": 0.5}


def log_steps(run_dir: Path, steps: range, tracker_ids: dict | None = None) -> dict[str, str]:
    cfg = compose(["metrics=all", "metrics.project=forge-test"])
    logger = MetricsLogger.from_config(cfg.metrics, run_dir, steps.stop - 1, tracker_ids, {"model": {"dim": 64}})
    for step in steps:
        logger.log_train(step, train_metrics(step))
    logger.log_eval(steps.stop - 1, 2.5)
    ids = logger.tracker_ids()
    logger.close()
    return ids


LOSSES = [(1, 10.0), (2, 5.0), (3, 10 / 3)]


def assert_points(actual, expected=LOSSES) -> None:
    """(step, value) pairs: equal steps, values equal up to float32 rounding (TensorBoard stores float32)."""
    actual = list(actual)
    assert [step for step, _ in actual] == [step for step, _ in expected]
    assert [value for _, value in actual] == pytest.approx([value for _, value in expected], rel=1e-6)


def wandb_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trackers")
    return run_dir, log_steps(run_dir, range(1, 4))


def test_tensorboard_events_read_back(first_run):
    run_dir, _ = first_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert_points((e.step, e.value) for e in events.Scalars("loss"))
    assert [e.step for e in events.Scalars("val_loss")] == [3]
    assert "tokens_per_s" in events.Tags()["scalars"]


def test_wandb_offline_run_file_read_back(first_run):
    run_dir, ids = first_run
    (path,) = wandb_files(run_dir)
    assert run_ids(path) == [ids["wandb"]]
    rows = [r for r in history(path) if "loss" in r]
    assert_points((r["_step"], r["loss"]) for r in rows)
    assert rows[-1]["lr"] == pytest.approx(3e-3)


def test_mlflow_file_store_read_back(first_run):
    run_dir, ids = first_run
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.dim"] == "64"
    losses = client.get_metric_history(ids["mlflow"], "loss")
    assert_points(sorted((m.step, m.value) for m in losses))


def test_resume_with_stored_ids_continues_the_same_runs(tmp_path):
    ids = log_steps(tmp_path, range(1, 3))
    assert set(ids) == {"wandb", "mlflow"}  # TensorBoard has no run id: it appends to the same folder
    resumed = log_steps(tmp_path, range(3, 5), tracker_ids=ids)
    assert resumed == ids
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    assert [m.step for m in sorted(client.get_metric_history(ids["mlflow"], "loss"), key=lambda m: m.step)] == [
        1,
        2,
        3,
        4,
    ]
    files = wandb_files(tmp_path)
    assert [run_ids(f) for f in files] == [[ids["wandb"]], [ids["wandb"]]]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]


def test_unknown_tracker_fails_naming_it(tmp_path):
    cfg = compose(["metrics.trackers=[tensorbord]"])
    with pytest.raises(ValueError, match="tensorbord"):
        MetricsLogger.from_config(cfg.metrics, tmp_path, 10)


class ListTracker:
    """A tracker of a user's own, built from its `_target_` like the three of conf/metrics/tracker."""

    logged: list[tuple[str, int, dict]] = []

    def __init__(self, prefix: str, *, run_dir, run_id, config, project, run_name):
        self.prefix, self.run_id = prefix, run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        ListTracker.logged.append((self.prefix, step, values))

    def close(self, exit_code: int = 0) -> None:
        ListTracker.logged.append((self.prefix, -1, {"exit_code": exit_code}))


def test_a_tracker_of_ones_own_is_one_more_tracker_config(tmp_path):
    cfg = compose([
        "+metrics.tracker_configs.mine={_target_:tests.metrics.test_trackers.ListTracker,prefix:run}",
        "metrics.trackers=[mine]",
    ])  # fmt: skip
    validate(cfg, world_size=1)
    ListTracker.logged.clear()
    logger = MetricsLogger.from_config(cfg.metrics, tmp_path, 2)
    assert [t.name for t in logger.trackers] == ["mine"]
    logger.log_train(1, train_metrics(1))
    logger.close()
    assert ListTracker.logged[0][:2] == ("run", 1) and ListTracker.logged[0][2]["loss"] == 10.0
    assert ListTracker.logged[-1] == ("run", -1, {"exit_code": 0})
