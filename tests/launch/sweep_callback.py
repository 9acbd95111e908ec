"""A Hydra callback for tests/launch/test_sweep_report.py: each job's return value, written to its output dir."""

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback


class RecordReturn(Callback):
    def on_job_end(self, config, job_return, **kwargs) -> None:
        out = Path(HydraConfig.get().runtime.output_dir)
        (out / "return_value.txt").write_text(repr(job_return.return_value))
