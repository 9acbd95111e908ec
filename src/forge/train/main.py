"""`forge-train`: compose the config with Hydra, validate it, train."""

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, InstantiationException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from forge.config import ConfigError, conf_dir, register_schemas, validate
from forge.config.degrees import Degrees
from forge.config.errors import composition_message, null_section_message
from forge.config.help import field_help
from forge.config.schema import ParallelConfig, TrainConfig
from forge.config.sections import RunSections
from forge.config.validate import null_group_refusal
from forge.data.sources import DataError
from forge.launch.sweep_point import FAILED_FILE, FINISHED_FILE, SWEEP_POINT_ENV, PointFailed
from forge.launch.sweep_resume import SweepFolderTaken, finished_objective
from forge.planning.flags import has_plan_flags

log = logging.getLogger("forge")

EXIT_CONFIG_ERROR = 2
PLAN_ONLY = False
"""Set by `--plan`: print the parallel plan and the memory estimate instead of training."""
LAST_FAILED_POINT: list[str | int] = []
"""The line and exit code of the last sweep point that stopped in this process (the search's end reports it)."""
CALIBRATE = False
COMPOSED = False
"""Set when Hydra has composed the config and the task starts: errors after it are not composition errors."""
"""Set by `--calibrate`: measure this machine and write a device profile for `--plan --search` instead of training."""


def build_trainer(cfg: DictConfig, degrees: Degrees, settings: RunSections):
    """The run's trainer (a VLM's with `vlm` set), built after the host is prepared and the model checked to fit."""
    prepare_host(settings.train)  # first: torch reads its huge-page switch at the process's first CPU allocation
    check_model_fits(cfg, degrees)
    from forge.train.trainer import Trainer
    from forge.train.vlm_trainer import VLMTrainer

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    trainer = VLMTrainer if cfg.get("vlm") is not None else Trainer
    return trainer(cfg, run_dir, degrees, settings)


def prepare_host(train: TrainConfig) -> None:
    """Where a CPU run's tensors live (forge.runtime.host_memory): a process-wide choice, made by the command."""
    from forge.parallel.env import read_dist_env
    from forge.runtime.host_memory import prepare_cpu_process
    from forge.train.build import resolve_device

    if resolve_device(train.device).type == "cpu":
        dist_env = read_dist_env()
        line = prepare_cpu_process(train.cpu_huge_pages, train.cpu_mmap_threshold_mib, dist_env.world_size)
        if dist_env.rank == 0:
            log.info("%s", line)


def check_model_fits(cfg: DictConfig, degrees) -> None:
    """A model too large for this run's devices is refused with its estimate (forge.train.fits_device)."""
    from forge.train.build import resolve_device
    from forge.train.fits_device import check_fits_device

    check_fits_device(cfg, degrees, resolve_device(cfg.train.device))


def fit_defaults_to_run(cfg: DictConfig) -> None:
    """Defaults that cannot hold for this run are fitted to it, with one warning line (rank 0)."""
    from forge.config.resolve import fit_warmup_to_run, override_keys
    from forge.parallel.env import read_dist_env

    note = fit_warmup_to_run(cfg, override_keys(OmegaConf.to_container(HydraConfig.get().overrides.task)))
    if note and read_dist_env().rank == 0:
        log.warning("%s", note)


def check_launched_world(parallel: ParallelConfig) -> None:
    """parallel.world_size, where set, must be the number of processes launched (it alone sizes `--plan`)."""
    from forge.parallel.env import read_dist_env

    expected, launched = parallel.world_size, read_dist_env().world_size
    if expected is not None and expected != launched:
        raise ConfigError(
            f"parallel.world_size={expected}, but {launched} process{'es were' if launched > 1 else ' was'} launched: "
            f"start {expected} (torchrun --nproc_per_node={expected}, or srun's tasks) or leave parallel.world_size "
            "unset to follow the launch"
        )


def check_output_dir() -> None:
    """An empty hydra.run.dir (or hydra.sweep.dir) would make the current directory the run directory."""
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    key = "hydra.sweep.dir" if hydra_cfg.mode == RunMode.MULTIRUN else "hydra.run.dir"
    if not str(OmegaConf.select(hydra_cfg, key.removeprefix("hydra.")) or "").strip():
        log_file = Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log"
        if log_file.is_file() and log_file.stat().st_size == 0:
            log_file.unlink()  # Hydra's log file, made in the current directory before this check
        raise ConfigError(f"{key} is empty: give the run a folder of its own (e.g. {key}=outputs/my-run)")


def _task(cfg: DictConfig) -> float | None:
    """One run (or sweep point); returns its objective, the last validation loss, for a sweeper that optimises it
    (Hydra records it as the job's return value; hydra-optuna-sweeper minimises it)."""
    global COMPOSED
    COMPOSED = True
    try:
        check_output_dir()
        fit_defaults_to_run(cfg)
        if CALIBRATE:
            from forge.planning.search.calibrate import run_calibration
            from forge.train.build import resolve_device

            run_calibration(resolve_device(cfg.train.device), Path(HydraConfig.get().runtime.output_dir))
            return
        if PLAN_ONLY and cfg.get("search") is not None:
            from forge.planning.search.report import search_report

            print(search_report(cfg), flush=True)
            return
        if PLAN_ONLY:
            from forge.planning.report import print_plan

            print_plan(cfg)
            return
        if in_sweep():
            kept, objective = finished_objective(output_dir(), OmegaConf.to_container(HydraConfig.get().overrides.task))
            if kept:
                log.info("sweep point kept: %s finished before (val loss %s); nothing to run", output_dir(), objective)
                return objective
        degrees = validate(cfg)  # before the trainer's heavy imports: a config error costs none of them
        settings = RunSections.of(cfg)
        check_launched_world(settings.parallel)
        summary = build_trainer(cfg, degrees, settings).fit()
    except SweepFolderTaken as err:
        stop(EXIT_CONFIG_ERROR, f"invalid sweep: {err}", "", record=False)
    except ConfigError as err:
        stop(EXIT_CONFIG_ERROR, f"invalid config: {err}", f"refused: {err}")
    except (DataError, InstantiationException) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) else err
        if not isinstance(cause, DataError):
            raise
        stop(1, str(cause), f"failed: {cause}")
    except Exception as err:
        from forge.checkpoint.errors import CheckpointError  # imported late: it brings torch.distributed.checkpoint

        if not isinstance(err, CheckpointError):
            record_failure(f"failed: {type(err).__name__}: {err}")
            raise
        stop(1, str(err), f"failed: {err}")
    if summary.get("preempted"):
        from forge.launch import requeue_via_submitit
        from forge.resilience import EXIT_PREEMPTED
        from forge.resilience.preemption import EXIT_INTERRUPTED

        if summary.get("signal") == "SIGINT":
            sys.exit(EXIT_INTERRUPTED)  # the user stopped it: checkpointed, not requeued

        requeue_via_submitit()  # under submitit: requeue the job (rank 0 does not return)
        sys.exit(EXIT_PREEMPTED)
    if in_sweep():
        record_finished(summary["final_val_loss"])
    return summary["final_val_loss"]


def output_dir() -> Path:
    """This run's (or sweep point's) folder."""
    return Path(HydraConfig.get().runtime.output_dir)


def in_sweep() -> bool:
    """This run is a point of a sweep: a Hydra multirun's job, or a point the torchrun launcher started."""
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN or os.environ.get(SWEEP_POINT_ENV) == "1"


def record_failure(status: str) -> None:
    """In a sweep, the point's folder keeps why it stopped (forge-sweep-report shows it as the point's status)."""
    if in_sweep():
        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        overrides = run_dir / ".hydra" / "overrides.yaml"
        if not overrides.is_file():  # the point's overrides, as Hydra writes them for a run that starts
            overrides.write_text(OmegaConf.to_yaml(hydra_cfg.overrides.task))
        (run_dir / FAILED_FILE).write_text(status + "\n")


def record_finished(objective: float | None) -> None:
    """The point's run ended normally: rank 0 records its objective (a sweep run again keeps the point) and drops
    the record of an earlier attempt's failure, once the run is over (every rank read the same records when the
    point started)."""
    import yaml

    from forge.files import write_text_atomic
    from forge.parallel.env import read_dist_env

    if read_dist_env().rank == 0:
        write_text_atomic(output_dir() / FINISHED_FILE, yaml.safe_dump({"val_loss": objective}))
        (output_dir() / FAILED_FILE).unlink(missing_ok=True)


def stop(code: int, line: str, status: str, record: bool = True) -> NoReturn:
    """One line and exit `code`. In a sweep the point records `status` (unless `record` is false: the folder holds
    another run) and the sweep goes on to its other points; alone, a refused config leaves no run directory behind."""
    print(f"forge-train: {line}", file=sys.stderr)
    if in_sweep():
        if record:
            record_failure(status)
        LAST_FAILED_POINT[:] = [line, code]
        raise PointFailed(line, code, str(HydraConfig.get().sweep.dir))
    if code == EXIT_CONFIG_ERROR:
        remove_empty_run_dir()
    sys.exit(code)


def remove_empty_run_dir() -> None:
    """After a config error: the run directory Hydra made holds only its own files, so nothing to keep. Every rank
    of a launch refuses the same config at about the same time, in the same directory: a file or folder another
    rank has removed already, or refilled, is left to it."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with contextlib.suppress(OSError):  # FileNotFoundError, or a folder another rank has written into
        entries = {p.name for p in run_dir.iterdir()}
        hydra_files = {p.name for p in (run_dir / ".hydra").iterdir()} if (run_dir / ".hydra").is_dir() else set()
        log_file = run_dir / "forge.log"
        if (
            entries <= {".hydra", "forge.log"}
            and hydra_files <= {"config.yaml", "hydra.yaml", "overrides.yaml"}
            and (not log_file.exists() or log_file.stat().st_size == 0)
        ):
            for name in hydra_files:
                (run_dir / ".hydra" / name).unlink(missing_ok=True)
            if (run_dir / ".hydra").is_dir():
                (run_dir / ".hydra").rmdir()
            log_file.unlink(missing_ok=True)
            if not any(run_dir.iterdir()) and run_dir.resolve() != Path.cwd().resolve():
                run_dir.rmdir()


def main() -> None:
    global PLAN_ONLY, CALIBRATE
    if has_plan_flags(sys.argv):
        from forge.planning.report import take_plan_flag

        PLAN_ONLY = take_plan_flag(sys.argv)
    CALIBRATE = "--calibrate" in sys.argv
    sys.argv[:] = [a for a in sys.argv if a != "--calibrate"]
    if CALIBRATE and PLAN_ONLY:
        print("forge-train: --calibrate measures this machine; run it without --plan", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    refusal = null_group_refusal(sys.argv[1:])
    if refusal:
        print(f"forge-train: invalid config: {refusal}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    register_schemas()
    if not OmegaConf.has_resolver("forge_field_help"):
        OmegaConf.register_new_resolver("forge_field_help", field_help)
    # Hydra prints what it cannot compose over several lines and exits 1; with HYDRA_FULL_ERROR it raises, and the
    # error becomes one line and exit 2 like the validation pass's (any other exception is raised as it was).
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")(_task)()
    except (ConfigCompositionException, OverrideParseException) as err:
        print(f"forge-train: invalid config: {composition_message(err)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    except (AttributeError, AssertionError) as err:  # OmegaConf's, unwrapped by Hydra (null_section_message)
        line = None if COMPOSED else null_section_message(err, sys.argv[1:])
        if line is None:
            raise
        print(f"forge-train: invalid config: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    except ValueError as err:  # Optuna's sweeper, asked for the best of trials that all stopped
        if "No trials are completed" not in str(err):
            raise
        line, code = LAST_FAILED_POINT or ("under another launcher", 1)
        print(f"forge-train: no trial of the search finished (the last: {line}); each one's folder says why "
              "(forge-sweep-report <the sweep's folder>)", file=sys.stderr)  # fmt: skip
        sys.exit(code)
    except PointFailed as err:  # raised again by Hydra's sweeper once every point has run
        if os.environ.get(SWEEP_POINT_ENV) != "1":
            print(f"forge-train: a sweep point stopped ({err.line}); the others ran: forge-sweep-report "
                  f"{err.sweep_dir}", file=sys.stderr)  # fmt: skip
        sys.exit(err.code)


if __name__ == "__main__":
    main()
