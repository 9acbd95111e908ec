"""Check, before any job is submitted, that a SLURM job's processes match the parallel plan.

A job of `nodes x tasks_per_node` processes (one per GPU) must be exactly the world the parallel degrees describe;
otherwise every task would fail at startup after waiting in the queue.
"""

import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from forge.config.degrees import resolve_degrees
from forge.config.errors import ConfigError

EXIT_CONFIG_ERROR = 2


def launch_world_size(config: DictConfig) -> int | None:
    """Processes one submitit job starts (nodes x tasks_per_node); None when no submitit launcher is selected."""
    launcher = config.hydra.get("launcher") if "hydra" in config else None
    if launcher is None or "submitit" not in str(launcher.get("_target_", "")):
        return None
    return int(launcher.get("nodes", 1)) * int(launcher.get("tasks_per_node", 1))


def check_launch_shape(config: DictConfig) -> None:
    """Raise ConfigError naming the fields when a submitit job's size does not fit the parallel plan."""
    world = launch_world_size(config)
    if world is None:
        return
    launcher, parallel = config.hydra.launcher, config.parallel
    shape = f"hydra.launcher.nodes={launcher.nodes} x hydra.launcher.tasks_per_node={launcher.tasks_per_node} = {world}"
    expected = parallel.get("world_size")
    if expected is not None and int(expected) != world:
        raise ConfigError(f"{shape} processes, but parallel.world_size={expected}")
    try:
        resolve_degrees(parallel, world)
    except ConfigError as err:
        raise ConfigError(f"{shape} processes do not fit the parallel plan: {err}") from None


class LaunchShapeCheck(Callback):
    """Hydra callback: the shape check once, before a sweep's jobs are submitted.

    Hydra turns exceptions raised in callbacks into warnings, so a misfit ends the process here (exit code 2, as
    forge-train does for any invalid config). A job whose swept overrides change the plan still fails in the trainer.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_launch_shape(config)
        except ConfigError as err:
            print(f"forge-train: invalid launch: {err}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
