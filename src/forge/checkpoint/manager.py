"""Save and resume a run with torch.distributed.checkpoint (DCP).

Model and optimizer go through `get_state_dict`/`set_state_dict`, so sharded and unsharded runs read each other's
checkpoints. Everything else a resume needs (step, tokens seen, scheduler, data-loader position, RNG states,
tracker run ids) is small per-rank state saved beside them with torch.save and read back with weights_only=True.

Resuming in another parallel layout. DCP stores every tensor whole under the whole model's parameter names (a
pipeline stage's too, see forge.checkpoint.stages) and reshards it to whatever the loading model holds; the loader
position counts samples of one global order, and epochs end at global-batch boundaries. So a checkpoint resumes
at any world size, one process included, and in any parallel layout (dp_replicate, dp_shard, tp, pp with any
schedule, ep) and micro_batch_size. The restored model and optimizer equal the saved ones bit for bit; the later
losses equal the uninterrupted run's up to the new layout's summation order. Tested (tests/checkpoint/
test_reshard.py): FSDP over 4 ranks into HSDP 2 x 2, TP 2 x FSDP 2, one process and interleaved 1F1B over pp 2
(whose two stages per rank are also saved under the whole model's names); FSDP over 2 and DDP over 2 passed the
same test before it was trimmed, and a 1F1B pp 2 checkpoint resumed in one process was checked by hand. An ep=2
checkpoint resumes at ep=4 (tests/parallel/test_expert_plan.py).
Must not change: the model config, train.global_batch_size, train.seq_len, train.seed, the data, and the optimizer
and scheduler kinds; changed optimizer settings and schedule are applied (forge.checkpoint.resume_check names every
changed key before the model is built; DCP refuses mismatched keys or shapes of a checkpoint without a config).
RNG states are per rank and are restored only at the same world size (nothing in training draws from them today:
no dropout).
"""

import logging
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from forge.checkpoint.compat import check_model_keys
from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.hf_load import is_hf_folder, load_hf_into
from forge.checkpoint.layout import (
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    mark_complete,
    resolve_checkpoint,
    step_dir,
    step_of,
)
from forge.checkpoint.optimizer_settings import apply_group_settings, group_settings
from forge.checkpoint.resume_check import Change, check_resume_config
from forge.checkpoint.rng import rng_state, set_rng_state
from forge.checkpoint.stages import rename, whole_model_keys, whole_model_names
from forge.checkpoint.untrusted import load_dcp
from forge.config.schema import CheckpointConfig

log = logging.getLogger("forge")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _earlier_checkpoint_hint(path: Path) -> str:
    """After a checkpoint failed to load: where an older complete one of the same run is, if any."""
    try:
        earlier = [p for p in complete_checkpoints(path.parent) if step_of(p) < step_of(path)]
    except CheckpointError:  # not a step-N folder: no neighbours to offer
        return ""
    if not earlier:
        return ""
    return f"; the checkpoint before it is complete and untouched: checkpoint.resume={earlier[-1]} resumes from it"


def async_save_group() -> dist.ProcessGroup | None:
    """A gloo group of all ranks for async saves: DCP runs the save's collectives in a background thread, which
    must not share a group with the training loop's collectives (they could interleave differently on each rank),
    and on GPUs the default group is NCCL, which DCP's CPU-side exchange cannot use. Collective: call on every
    rank. None for one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


@dataclass
class RunState:
    """What a checkpoint restores besides model and optimizer."""

    step: int = 0
    tokens_seen: int = 0
    tracker_ids: dict = field(default_factory=dict)


class Checkpointer:
    """Periodic saves, retention, and resuming for one run."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, config_yaml: str = ""):
        self.cfg = cfg
        root = Path(cfg.dir)
        self.root = root if root.is_absolute() else Path(run_dir) / root
        self.config_yaml = config_yaml
        self._pending: tuple[Future, Path] | None = None
        self._unsealed: Path | None = None  # rank 0: an async save every rank may not have finished yet
        self.last_save_error: str | None = None  # the message of the latest save, when it failed
        self._foreign: set[Path] = set()  # checkpoints of another run beside this one (checkpoint.overwrite)
        self._reported: set[Path] = set()  # checkpoints whose changed settings were logged
        self.is_async = cfg.async_mode != "sync"
        self.async_group = async_save_group() if self.is_async else None

    # ---- saving -------------------------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """When the run will save: the checkpoint folder can be made and written, else a CheckpointError naming
        checkpoint.dir (or a warning under checkpoint.on_save_error=continue)."""
        cfg = self.cfg
        if not (cfg.interval > 0 or cfg.save_final or cfg.milestones):
            return
        probe = self.root / f".write-test-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            message = f"checkpoint.dir={cfg.dir}: cannot write checkpoints to {self.root}: {err.strerror or err}"
            if cfg.on_save_error == "continue":
                log.warning("%s (checkpoint.on_save_error=continue: training anyway)", message)
                return
            raise CheckpointError(message) from err

    def check_run_dir(self) -> None:
        """A run that does not continue this run directory's own checkpoints (checkpoint.resume=none or another
        path) must not mix with them: refused unless checkpoint.overwrite=true, and then retention never deletes
        them (only what this run wrote). Call before the model is built."""
        existing = complete_checkpoints(self.root)
        own = latest_checkpoint(self.root)
        resumes_here = self.cfg.resume == "auto" or (  # its latest or an earlier one (say, the latest is corrupt)
            self.cfg.resume not in ("none", "", None)
            and own is not None
            and resolve_checkpoint(self.cfg.resume).parent.resolve() == self.root.resolve()
        )
        if not existing or resumes_here:
            return
        if not self.cfg.overwrite:
            raise CheckpointError(
                f"{self.root} already holds {len(existing)} checkpoint(s) of another run (latest {existing[-1].name}) "
                f"and checkpoint.resume={self.cfg.resume} starts a new one: use another hydra.run.dir, "
                "checkpoint.resume=auto to continue it, or checkpoint.overwrite=true to write beside them"
            )
        self._foreign = set(existing)

    def should_save(self, step: int, last_step: int) -> bool:
        interval = self.cfg.interval
        periodic = interval > 0 and step % interval == 0
        final = step == last_step and (interval > 0 or self.cfg.save_final)
        return periodic or final or step in self.cfg.milestones

    def save(self, step: int, model, optimizer, scheduler, loader, run_state: RunState) -> Path | None:
        """Write a checkpoint of `step`; visible (sealed, `latest`) only once every rank finished writing.

        A failed write (full disk, unwritable folder) raises CheckpointError, or with checkpoint.on_save_error=continue
        is logged and training goes on; either way the previous checkpoint stays the latest.
        """
        try:
            saved = self._save(step, model, optimizer, scheduler, loader, run_state)
            self.last_save_error = None
            return saved
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - every failure to write: one clear error
            path = step_dir(self.root, step)
            if _rank() == 0 and path.exists() and not is_complete(path):
                shutil.rmtree(path, ignore_errors=True)  # a partial folder would keep a full disk full
            free = shutil.disk_usage(self.root).free if self.root.exists() else 0
            reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            message = f"cannot write checkpoint {path}: {reason} ({free / 1e6:.1f} MB free on that disk)"
            self.last_save_error = message
            if self.cfg.on_save_error == "continue":
                log.error("%s; training continues, the latest checkpoint is still %s", message, self.latest())
                self._pending = None
                return None
            raise CheckpointError(message) from err

    def _save(self, step: int, model, optimizer, scheduler, loader, run_state: RunState) -> Path:
        self.wait()
        path = step_dir(self.root, step)
        if _rank() == 0:
            if path.exists():
                shutil.rmtree(path)  # a leftover of an interrupted save of the same step
            path.mkdir(parents=True)
            if self.config_yaml:
                (path / "config.yaml").write_text(self.config_yaml)
        _barrier()
        extra = {
            "step": step,
            "tokens_seen": run_state.tokens_seen,
            "tracker_ids": dict(run_state.tracker_ids),
            "scheduler": scheduler.state_dict(),
            "loader": loader.state_dict(),
            "rng": rng_state(),
            "world_size": _world(),
        }
        torch.save(extra, path / f"extra-rank{_rank()}.pt")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        model_sd, optim_sd = rename(model_sd, optim_sd, whole_model_names(model, model_sd))
        state = {"model": model_sd, "optim": optim_sd}
        mode = self.cfg.async_mode
        if mode == "sync":
            dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
            self._seal(path)
        else:
            future = dcp.async_save(
                state,
                checkpoint_id=str(path),
                async_stager=self._stager(mode),
                no_dist=not dist.is_initialized(),
                process_group=self.async_group,
            )
            self._pending = (future if isinstance(future, Future) else future.upload_completion, path)
        return path

    def poll(self) -> None:
        """Called every step: seal a finished async save without blocking or a collective.

        Each rank leaves a marker when its own write finished; rank 0 seals once every rank's marker is there.
        Every rank forgets its own save as soon as it finished, so all ranks stay in step for `wait`.
        """
        if self._pending is not None and self._pending[0].done():
            self._finish_own_write()
        if self._unsealed is not None and all((self._unsealed / f".done-rank{r}").exists() for r in range(_world())):
            self._seal_on_rank0(self._unsealed)
            self._unsealed = None

    def _finish_own_write(self) -> None:
        future, path = self._pending
        self._pending = None
        future.result()
        (path / f".done-rank{_rank()}").touch()
        if _rank() == 0:
            self._unsealed = path

    @staticmethod
    def _stager(mode: str):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        pinned = mode == "async_pinned" and torch.cuda.is_available()
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
            )
        )

    def wait(self) -> None:
        """Finish an outstanding async save and seal it. Collective: every rank calls it (before each save and at
        the end), whether or not it still has a write in flight, so the barriers always pair."""
        if not self.is_async:
            return  # sync saves seal as they write
        if self._pending is not None:
            self._finish_own_write()
        _barrier()  # every rank's marker is on disk now
        if self._unsealed is not None:
            self._seal_on_rank0(self._unsealed)
            self._unsealed = None
        _barrier()

    def _seal(self, path: Path) -> None:
        _barrier()
        if _rank() == 0:
            self._seal_on_rank0(path)
        _barrier()

    def _seal_on_rank0(self, path: Path) -> None:
        if not is_complete(path):
            mark_complete(self.root, path)
            self._prune()
            log.info("checkpoint saved: %s", path)

    def _prune(self) -> None:
        milestones = set(self.cfg.milestones)
        periodic = [
            p for p in complete_checkpoints(self.root) if step_of(p) not in milestones and p not in self._foreign
        ]
        for old in periodic[: -self.cfg.keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- resuming -----------------------------------------------------------------------------------------------

    def check_resume(self, path: Path | None = None) -> list[Change]:
        """This run's config against the checkpoint it resumes (default: resume_path()): refused changes raise
        (unless checkpoint.check_resume_config=false), the others are named in one line. Call before the model is
        built, so a refused resume costs nothing."""
        path = self.resume_path() if path is None else path
        if path is None or not self.config_yaml or not is_complete(path):
            return []
        enforce = self.cfg.check_resume_config
        changes = check_resume_config(path, OmegaConf.create(self.config_yaml), enforce=enforce)
        if changes and path not in self._reported:
            self._reported.add(path)
            shown = [f"{c} ({'not checked' if c.kind == 'refused' else c.kind})" for c in changes]
            level = logging.INFO if all(c.kind == "free" for c in changes) else logging.WARNING
            log.log(level, "resuming from %s with changed settings: %s", path, "; ".join(shown))
        return changes

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from: per checkpoint.resume (auto | none | PATH)."""
        resume = self.cfg.resume
        if resume in ("none", "", None):
            return None
        if resume == "auto":
            return latest_checkpoint(self.root)
        return resolve_checkpoint(resume)

    def latest(self) -> Path | None:
        """The newest complete checkpoint of this run."""
        return latest_checkpoint(self.root)

    def load(self, path: Path, model, optimizer, scheduler, loader) -> RunState:
        """Restore model, optimizer, scheduler, loader and RNG from a complete checkpoint."""
        if not is_complete(path):
            raise CheckpointError(f"checkpoint {path} is incomplete")
        changes = self.check_resume(path)
        settings = group_settings(optimizer)  # as this run's config builds them, before the checkpoint's replace them
        model_sd, optim_sd = get_state_dict(model, optimizer)
        names = whole_model_names(model, model_sd)
        model_sd, optim_sd = rename(model_sd, optim_sd, names)
        check_model_keys(path, model_sd, whole_keys=whole_model_keys(model))
        state = {"model": model_sd, "optim": optim_sd}
        try:
            load_dcp(state, path, no_dist=not dist.is_initialized())
        except CheckpointError as err:
            raise CheckpointError(f"{err}{_earlier_checkpoint_hint(path)}") from err
        model_sd, optim_sd = rename(state["model"], state["optim"], {v: k for k, v in names.items()})
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        extra = self._extra(path)
        scheduler.load_state_dict(extra["scheduler"])
        loader.load_state_dict(extra["loader"])
        if extra.get("world_size") == _world():
            set_rng_state(extra["rng"])
        if any(c.kind == "applied" for c in changes):
            apply_group_settings(optimizer, scheduler, settings, loader.lr_scale)
        log.info("resumed from %s at step %d", path, extra["step"])
        return RunState(step=extra["step"], tokens_seen=extra["tokens_seen"], tracker_ids=extra["tracker_ids"])

    @staticmethod
    def _extra(path: Path) -> dict:
        own = path / f"extra-rank{_rank()}.pt"
        file = own if own.is_file() else path / "extra-rank0.pt"
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} lacks {file.name}")
        try:
            return torch.load(file, weights_only=True)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"cannot read {file}: {err}") from err

    def load_weights(self, source: str, model, exclude: tuple[str, ...] = ()) -> Path:
        """Warm start: model weights only (keys starting with an `exclude` prefix keep their init), from a forge
        checkpoint or run directory, or from a Hugging Face folder (read slice by slice, forge.checkpoint.hf_load)."""
        hf_folder = is_hf_folder(source)
        path = Path(source).expanduser() if hf_folder else resolve_checkpoint(source)
        model_sd = get_model_state_dict(model)
        names = whole_model_names(model, model_sd)
        model_sd, _ = rename(model_sd, None, names)
        whole = whole_model_keys(model)
        known = whole if whole is not None else set(model_sd)
        for prefix in exclude:
            if not any(key.startswith(prefix) for key in known):
                tops = sorted({key.split(".")[0] + "." for key in known})
                raise CheckpointError(
                    f"checkpoint.load_weights_exclude has {prefix!r}, which starts no parameter name of this model "
                    f"(they start with {', '.join(tops)})"
                )
        if hf_folder:
            load_hf_into(model, path, exclude)
            return path
        check_model_keys(path, model_sd, exclude=exclude, whole_keys=whole)
        wanted = {k: v for k, v in model_sd.items() if not k.startswith(exclude)}
        state = {"model": wanted}
        load_dcp(state, path, no_dist=not dist.is_initialized(), action="load weights from")
        loaded, _ = rename(state["model"], None, {v: k for k, v in names.items()})
        set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
        log.info("warm start: weights from %s", path)
        return path
