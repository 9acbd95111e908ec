"""TensorBoard event files through torch's SummaryWriter."""

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from forge.metrics.trackers.base import numeric


class TensorBoardTracker:
    """Scalars under run_dir/log_dir; TensorBoard has no run id to resume (it appends to the folder)."""

    name = "tensorboard"
    run_id: str | None = None

    def __init__(
        self,
        log_dir: str,
        *,
        run_dir: Path,
        run_id: str | None,
        config: dict | None,
        project: str,
        run_name: str | None,
    ):
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / log_dir))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in numeric(values).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, exit_code: int = 0) -> None:
        self.writer.close()  # event files have no run status; every scalar is already flushed
