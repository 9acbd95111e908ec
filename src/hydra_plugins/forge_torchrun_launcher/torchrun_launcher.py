"""`forge-train -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 optimizer.lr=1e-3,3e-3`: each sweep point
runs as its own `torchrun --standalone --nproc_per_node=N -m forge.train <its overrides>` on this machine, one after
the other, in the point's folder of the sweep directory, so a sweep of data-, tensor- or pipeline-parallel runs needs
no cluster. Each point's return value is its last validation loss (read from its metrics.jsonl); a point that fails
is a failed job, as under Hydra's own launcher. A point that finished when the sweep last ran in this folder is kept
without starting torchrun (forge.launch.sweep_resume)."""

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from forge.launch.sweep_point import FAILED_FILE, SWEEP_POINT_ENV, PointFailed

log = logging.getLogger(__name__)


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.forge_torchrun_launcher.torchrun_launcher.TorchrunLauncher"
    nproc_per_node: int = 2
    """Processes per sweep point (torchrun's --nproc_per_node)."""
    timeout_s: Optional[float] = None
    """Wall-clock limit of one point; None: none."""


ConfigStore.instance().store(group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="forge")


class TorchrunLauncher(Launcher):
    def __init__(self, nproc_per_node: int = 2, timeout_s: Optional[float] = None) -> None:
        super().__init__()
        self.nproc_per_node, self.timeout_s = nproc_per_node, timeout_s
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        log.info("Launching %d jobs under torchrun, %d processes each", len(job_overrides), self.nproc_per_node)
        returns = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = sweep_config.hydra.job.num = idx
            job_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
            shown = filter_overrides(overrides)
            log.info("\t#%d : %s", idx, " ".join(shown))
            if kept := kept_point(list(overrides), shown, job_dir):
                returns.append(kept)
                continue
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={self.nproc_per_node}", "-m", "forge.train", *shown, f"hydra.run.dir={job_dir}",
            ]  # fmt: skip
            # the point records why it stopped, if it does, and the sweep goes on (forge.train.main.stop)
            done = subprocess.run(command, timeout=self.timeout_s, env={**os.environ, SWEEP_POINT_ENV: "1"})
            returns.append(job_return(list(overrides), job_dir, done.returncode))
        return returns


def kept_point(overrides: list[str], shown: list[str], job_dir: Path) -> Optional[JobReturn]:
    """A point that finished when the sweep ran before: its return, read back (forge.launch.sweep_resume); None when
    it must run (a folder holding other overrides is refused by the point's own processes)."""
    from forge.config.errors import ConfigError
    from forge.launch.sweep_resume import finished_objective

    try:
        kept, objective = finished_objective(job_dir, shown)
    except ConfigError:
        return None
    if not kept:
        return None
    log.info("\t   kept: %s finished before (val loss %s)", job_dir, objective)
    ret = JobReturn(overrides=overrides, working_dir=str(job_dir), status=JobStatus.COMPLETED)
    ret._return_value = objective
    return ret


def job_return(overrides: list[str], job_dir: Path, returncode: int) -> JobReturn:
    """What Hydra's sweeper reads of a point: its status and return value (the last validation loss)."""
    ret = JobReturn(overrides=overrides, working_dir=str(job_dir))
    if returncode != 0:
        recorded = job_dir / FAILED_FILE
        why = recorded.read_text().strip() if recorded.is_file() else f"exited with {returncode}"
        ret.status = JobStatus.FAILED
        code = 2 if why.startswith("refused:") else returncode  # torchrun exits 1 whatever its processes exited with
        ret._return_value = PointFailed(f"{' '.join(overrides)}: {why}", code, str(job_dir.parent))
        return ret
    from forge.launch.sweep_report import read_point  # here: Hydra imports this module at every start-up

    ret.status = JobStatus.COMPLETED
    ret._return_value = read_point(job_dir).val_loss
    return ret
