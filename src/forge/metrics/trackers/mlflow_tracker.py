"""MLflow through MlflowClient; a local file store in run_dir/mlruns unless its tracking_uri is set.

MLflow 3 keeps the file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE is set; we set it
(for file: URIs only) because a file store needs no database packages and no server.
"""

import os
import time
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from forge.metrics.trackers.base import numeric


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b": "value"} (MLflow params are flat strings)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:6000]
    return flat


class MlflowTracker:
    """One MLflow run in experiment `metrics.project`; a given run_id continues that run."""

    name = "mlflow"

    def __init__(
        self,
        tracking_uri: str | None,
        *,
        run_dir: Path,
        run_id: str | None,
        config: dict | None,
        project: str,
        run_name: str | None,
    ):
        uri = tracking_uri or (Path(run_dir) / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run = self.client.create_run(experiment_id, run_name=run_name)
            run_id = run.info.run_id
            if config:
                params = [Param(k, v) for k, v in flatten(config).items()]
                for start in range(0, len(params), 100):
                    self.client.log_batch(run_id, params=params[start : start + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id: str | None = run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in numeric(values).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, exit_code: int = 0) -> None:
        # 75 is a preemption whose final save overran its deadline: the job was stopped, not broken.
        status = {0: "FINISHED", 75: "KILLED"}.get(exit_code, "FAILED")
        self.client.set_terminated(self.run_id, status=status)
