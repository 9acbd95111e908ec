"""What a sweep point leaves for the sweep's report when it stops early (forge.train.main.stop), shared by the
training command, the torchrun launcher and forge-sweep-report without importing one another."""

FAILED_FILE = "failed.txt"
"""In a sweep point's folder: why the point stopped, one line (`refused: ...` or `failed: ...`)."""
FINISHED_FILE = "finished.yaml"
"""In a sweep point's folder: written when its run ended normally (`val_loss: <its objective>`); a sweep run again
keeps the point (forge.launch.sweep_resume)."""
SWEEP_POINT_ENV = "FORGE_SWEEP_POINT"
"""Set to 1 by a launcher that starts each sweep point as a run of its own (hydra/launcher=torchrun)."""


class PointFailed(Exception):
    """A sweep point stopped with a one-line reason, recorded in its folder; the sweep runs its other points, and
    Hydra's sweeper raises this once they have run (forge-train then prints the line and exits with `code`)."""

    def __init__(self, line: str, code: int, sweep_dir: str):
        super().__init__(line)
        self.line, self.code, self.sweep_dir = line, code, sweep_dir

    def __reduce__(self):  # pickled back from a SLURM job by submitit
        return PointFailed, (self.line, self.code, self.sweep_dir)
