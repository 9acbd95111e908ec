"""Validate every point of a sweep before the first one runs.

Hydra composes and runs the points of `forge-train -m` one after the other, so a bad point (say
`optimizer.lr=-1,1e-3`) used to fail only when its turn came, and stopped every point after it. This callback
expands the sweep as Hydra's basic sweeper will, composes each point and runs forge's validation on it. When every
point is refused, nothing runs (one line, exit 2). Otherwise each refused point is named up front and the sweep
runs: a refused point stops at once, recording why in its folder (forge.train.main.stop), the others train, and
forge-train exits 2 once they have (forge-sweep-report lists the refused point with its reason).
"""

import sys
from typing import Any

from hydra.core.override_parser.types import Override, ValueType
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from forge.config.errors import ConfigError, composition_message

EXIT_CONFIG_ERROR = 2


def sweep_points(task_overrides: list[str]) -> list[list[str]]:
    """The override lists of every job of a sweep, in the order the basic sweeper runs them. A search interval
    (`interval(1e-4, 1e-2)`, which only a searching sweeper such as Optuna samples) is left at its default: the
    points then check every other key, and each sampled value is checked when its trial runs."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = [o for o in parse(task_overrides) if o.value_type != ValueType.INTERVAL_SWEEP]
    return [point for batch in BasicSweeper.split_arguments(parsed, max_batch_size=None) for point in batch]


def parse(task_overrides: list[str]) -> list[Override]:
    """Hydra's parse of command-line overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(task_overrides)


def basic_sweeper_refusal(config: DictConfig) -> str | None:
    """Hydra's basic sweeper runs lists, not intervals: it fails on one with a traceback."""
    if "BasicSweeper" not in str(OmegaConf.select(config, "hydra.sweeper._target_") or ""):
        return None
    task = OmegaConf.to_container(config.hydra.overrides.task)
    intervals = [o.input_line for o in parse(task) if o.value_type == ValueType.INTERVAL_SWEEP]
    if not intervals:
        return None
    return (f"{intervals[0]} is a search interval, which the basic sweeper cannot run: sweep it with an Optuna "
            "search (hparams_search=lr_optuna names its keys in hydra.sweeper.params; or hydra/sweeper=optuna) or "
            "give a list of values")  # fmt: skip


def check_sweep(config: DictConfig) -> tuple[int, list[str]]:
    """How many points the sweep has, and a line for each point it refuses: the point and why."""
    from hydra import compose

    from forge.config.resolve import fit_warmup_to_run, override_keys
    from forge.config.validate import validate
    from forge.launch.shape import launch_world_size
    from forge.parallel.env import read_dist_env

    world = launch_world_size(config) or read_dist_env().world_size
    points = sweep_points(OmegaConf.to_container(config.hydra.overrides.task))
    refused = []
    for point in points:
        try:
            cfg = compose(config_name="train", overrides=point)
            fit_warmup_to_run(cfg, override_keys(point))
            validate(cfg, world_size=cfg.parallel.world_size or world)
        except ConfigError as err:
            refused.append(f"sweep point {' '.join(point)}: {err}")
        except HydraException as err:  # a point Hydra cannot compose: one line as well
            refused.append(f"sweep point {' '.join(point)}: {composition_message(err)}")
        except Exception as err:  # noqa: BLE001 - whatever else stops a point: one line as well
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            refused.append(f"sweep point {' '.join(point)}: {reason}")
    return len(points), refused


class SweepCheck(Callback):
    """Hydra callback: every point validated once, before any job starts or is submitted; a sweep of refused points
    only exits 2 there."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if refusal := basic_sweeper_refusal(config):
            print(f"forge-train: invalid sweep: {refusal}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
        total, refused = check_sweep(config)
        if refused and len(refused) == total:
            print(f"forge-train: invalid sweep: {refused[0]}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
        for line in refused:
            print(f"forge-train: refused, the other points run: {line}", file=sys.stderr)
