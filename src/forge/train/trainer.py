"""The training loop: data, forward/backward/step, eval, metrics."""

import contextlib
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from forge.checkpoint import Checkpointer, CheckpointError, RunState
from forge.checkpoint.hf_save import save_run_hf
from forge.checkpoint.run_lock import hold_run_dir
from forge.config import validate
from forge.config.degrees import Degrees, defers_grad_sync
from forge.config.sections import RunSections
from forge.metrics.logger import format_duration
from forge.metrics.setup import build_metrics_logger, build_profiler, build_step_meter, config_dict
from forge.models.common.moe import moe_layers, moe_metrics, update_router_biases
from forge.parallel import dist
from forge.parallel.context_parallel import ContextSplit
from forge.parallel.expert import sum_over_token_ranks_in_place
from forge.parallel.mesh import build_mesh, dp_rank_and_size, stage_groups
from forge.parallel.pipeline import Pipeline, build_pipeline
from forge.parallel.plan import float8_all_gather_enabled, parallelize, param_dtype
from forge.resilience import EXIT_PREEMPTED, flight_recorder
from forge.resilience.guard import RollbackRequested, StepGuard
from forge.resilience.hard_exit import on_hard_exit
from forge.resilience.health import check_device
from forge.resilience.preemption import EXIT_INTERRUPTED, PreemptionHandler
from forge.runtime import host_memory
from forge.train import build
from forge.train.compute_weights import ComputeWeights, compute_weights
from forge.train.debug_modes import RepeatedBatches, debug_modes
from forge.train.freeze import Unfrozen
from forge.train.losses import cross_entropy
from forge.train.masked_step import applied_where, masks_on_device
from forge.train.precision import holds_weight_casts, resolve_dtype
from forge.train.run_files import save_hydra_files
from forge.train.steps import PipelineStep, Step, TextStep, token_mean

log = logging.getLogger("forge")


def set_optimizer_mode(optimizer, mode: str) -> None:
    """Call optimizer.train() or .eval() where it has them: a schedule-free optimizer steps from one point and
    evaluates (and saves) another."""
    switch = getattr(optimizer, mode, None)
    if callable(switch):
        switch()


class NullMetrics:
    """The metrics of ranks other than 0: only rank 0 writes metrics.jsonl and log lines."""

    def log_train(self, step: int, metrics: dict) -> None: ...

    def log_eval(self, step: int, val_loss: float) -> None: ...

    def close(self, exit_code: int = 0) -> None: ...

    def tracker_ids(self) -> dict[str, str]:
        return {}


class Trainer:
    """Builds every piece from the composed config, then runs the loop."""

    def __init__(
        self, cfg: DictConfig, run_dir: Path, degrees: Degrees | None = None, settings: RunSections | None = None
    ):
        """`degrees`: what validate(cfg) returned, when the caller (forge-train) validated the config already;
        None validates it here (a trainer built in-process). `settings`: the caller's RunSections.of(cfg), or None
        to take them here."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.degrees = validate(cfg) if degrees is None else degrees
        self.settings = settings = settings or RunSections.of(cfg)  # what the components read, typed
        # first: a preemption signal during a long start-up must still end in a checkpoint, not in death by signal
        res = settings.resilience
        self.preemption = PreemptionHandler(list(res.preemption_signals), res.preemption_deadline_s)
        train = settings.train
        if train.threads > 0:
            torch.set_num_threads(train.threads)
        torch.manual_seed(train.seed)
        self.device = build.resolve_device(train.device)
        if self.device.type == "cpu" and not host_memory.PREPARED and self.degrees.world_size > 1:
            # built in-process (benchmarks, tests): still bound FSDP ranks' resident memory; keeping one process's
            # heap and huge pages stay the command's process-wide choices
            host_memory.configure_host_malloc(train.cpu_mmap_threshold_mib, self.degrees.world_size)
        self.dtype = resolve_dtype(train.dtype, self.device)
        check_device(self.device)
        flight_recorder.enable(res.flight_recorder_entries)  # read when the process groups are made
        self.owns_process_group = dist.init_distributed(self.device, timeout_s=res.collective_timeout_s)
        self.run_dir = Path(dist.shared_run_dir(str(self.run_dir)))
        if not dist.is_main_process():
            log.setLevel(logging.WARNING)
        ckpt = settings.checkpoint
        self.run_lock = hold_run_dir(self.run_dir, ckpt.run_lock, ckpt.run_lock_timeout_s)  # one job per run dir
        self.checkpointer = Checkpointer(ckpt, self.run_dir, build.config_yaml(cfg))
        self.checkpointer.check_run_dir()  # a fresh run never mixes with another run's checkpoints
        self.checkpointer.check_resume()  # a refused resume costs no model build and leaves the run as it was
        if dist.is_main_process():
            self.checkpointer.check_writable()  # before the model is built, not at the first save
            save_hydra_files(self.run_dir, cfg)  # this run owns the directory now: its config replaces the last one
        self.mesh = build_mesh(self.degrees, self.device.type)
        self.sum_loads = sum_over_token_ranks_in_place(self.mesh)  # the routers' loads, for their bias update
        self.dp_rank, self.dp_size = dp_rank_and_size(self.mesh)
        # under torchft the replica groups split the global batch: this rank reads its group's share
        replicas = res.ft_replicas if res.fault_tolerance == "torchft" else 1
        self.data_rank = res.ft_replica_id * self.dp_size + self.dp_rank if replicas > 1 else self.dp_rank
        self.data_size = self.dp_size * replicas

        self.loss_fn = build.build_loss(cfg)
        self.grad_accum = train.global_batch_size // (train.micro_batch_size * self.data_size)
        self.tokens_per_step = train.global_batch_size * train.seq_len
        # per rank: eval_batches global batches over this group's data-parallel ranks
        self.eval_micro_batches = (
            train.eval_batches * train.global_batch_size // (train.micro_batch_size * self.dp_size)
        )
        self.defer_grad_sync = defers_grad_sync(
            self.degrees, settings.parallel.pp_schedule, settings.parallel.defer_grad_sync
        )
        # a pipeline's step keeps its casts for the schedule's chunks (one autocast scope around the schedule)
        self.holds_weight_casts = self.degrees.pp == 1 and holds_weight_casts(
            self.dtype, self.grad_accum, self.degrees.fsdp_shard > 1, settings.parallel.activation_checkpoint != "none"
        )

        self.build_model_and_data()
        self.log_weight_casts()
        self.float8_all_gather = float8_all_gather_enabled(self.model)
        self.optimizer, self.scheduler = build.build_optimizer(cfg, self.model)
        set_optimizer_mode(self.optimizer, "train")  # schedule-free: DCP's state init takes a (zero-lr) step
        self.masked_updates = masks_on_device(self.optimizer)  # a non-finite step's update is dropped on the device
        self.loader = build.build_loader(settings.train, self.corpus, self.data_rank, self.data_size)
        if train.overfit_batches:
            self.loader = RepeatedBatches(self.loader, train.overfit_batches * self.grad_accum)
        self.state = self.restore()
        self.guard = StepGuard(res, self.preemption, self.run_dir, stage_groups(self.mesh, self.degrees.world_size))
        self.replicas = self.join_replica_groups()
        self.preempted = False
        self.metrics = (
            build_metrics_logger(settings, config_dict(cfg), self.run_dir, self.state.tracker_ids)
            if dist.is_main_process()
            else NullMetrics()
        )
        self.state.tracker_ids.update(self.metrics.tracker_ids())
        self.meter = build_step_meter(settings, self.model, self.device, self.dtype)
        self.profiler = build_profiler(settings, self.run_dir, self.device)
        n_params = self.n_params
        log.info(
            "model %.2fM parameters | %d steps x %d tokens | grad accum %d | device %s | %s",
            n_params / 1e6,
            train.steps,
            self.tokens_per_step,
            self.grad_accum,
            self.device,
            self.dtype,
        )

    def join_replica_groups(self):
        """Under resilience.fault_tolerance=torchft, this rank's part in the replica groups (else None). Their
        gradients are averaged as token means, so the step body divides by its own token count first."""
        if self.settings.resilience.fault_tolerance != "torchft":
            return None
        from forge.resilience.replica_groups import ReplicaGroups

        self.step_body.count_folded = False
        return ReplicaGroups(self.settings.resilience, self.device, self.replica_state, self.load_replica_state)

    def stop_uncommitted(self) -> None:
        """After a dropped step under torchft: nothing to do unless a stop was signalled, then the checkpoint of the
        last committed step."""
        if self.preempted:
            with self.meter.paused():
                self.save_checkpoint()
            self.log_preempted(self.state.step)

    def replica_state(self) -> dict:
        """What a live replica group sends a restarted one: this rank's local shards and the run's position."""
        from forge.resilience.replica_groups import local_tree

        return {
            "model": local_tree(self.model.state_dict()),
            "optimizer": local_tree(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
        }

    def load_replica_state(self, state: dict) -> None:
        from forge.resilience.replica_groups import load_model_shards, load_optimizer_shards

        load_model_shards(self.model, state["model"])
        load_optimizer_shards(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.state.step, self.state.tokens_seen = state["step"], state["tokens_seen"]
        self.meter.restart(self.state.step, self.state.tokens_seen)
        log.warning(
            "replica group %d: took a live group's state at step %d (weights, optimizer, schedule, data position)",
            self.settings.resilience.ft_replica_id,
            self.state.step,
        )

    def build_model_and_data(self) -> None:
        """Corpus, model (parallelized and initialised), its freeze schedule and the step body that trains it (the
        pipeline's with parallel.pp > 1); a VLM trainer builds its own."""
        cfg = self.cfg
        with dist.local_rank_zero_first():
            self.corpus = build.build_corpus(cfg)
        self.model = build.build_meta_model(cfg)
        self.n_params = sum(p.numel() for p in self.model.parameters())  # the whole model, before any split
        self.freeze = Unfrozen()
        self.pipeline: Pipeline | None = None
        self.step_body: Step
        context = ContextSplit(self.mesh["cp"]) if self.degrees.cp > 1 else None
        if self.degrees.pp > 1:
            self.pipeline = self.build_pipeline()
            self.step_body = PipelineStep(
                self.pipeline, self.device, self.dtype, self.defer_grad_sync, self.mesh, context
            )
        else:
            parallelize(self.model, self.mesh, self.degrees, self.settings.parallel, self.device, self.dtype)
            build.materialize_parallel(cfg, self.model, self.device, self.settings.train.seed)
            self.step_body = TextStep(
                self.model,
                self.device,
                self.dtype,
                self.mesh,
                self.defer_grad_sync,
                context=context,
                hold_weight_casts=self.holds_weight_casts,
                compute_weights=self.build_compute_weights(),
            )
        self.model = self.step_body.model

    def build_compute_weights(self) -> ComputeWeights | None:
        """The bf16 copy of the weights the steps compute with, on a model whose parameters are plain tensors
        (FSDP gathers its own in parallel.param_dtype); None in fp32 or under float8."""
        parallel = self.settings.parallel
        if parallel.fp8:
            return None
        return compute_weights(self.model, param_dtype(parallel, self.dtype), fixed=parallel.cuda_graphs)

    def log_weight_casts(self) -> None:
        """Say how the step meets bf16: one copy of the weights, or autocast's casts held over its micro-batches."""
        if getattr(self.step_body, "compute_weights", None) is not None:
            log.info("weights: fp32 master, one bf16 copy per step for its forwards and backwards")
        elif getattr(self.step_body, "hold_weight_casts", False):
            log.info("bf16 casts of the weights: once per step, for its %d micro-batches", self.grad_accum)

    def build_pipeline(self) -> Pipeline:
        """This rank's pipeline stages, parallelized and initialised as the whole model would be in one process."""
        parallel = self.settings.parallel
        return build_pipeline(
            self.model,
            self.mesh,
            self.degrees,
            parallel,
            self.device,
            loss_fn=cross_entropy,
            parallelize=lambda part: parallelize(part, self.mesh, self.degrees, parallel, self.device, self.dtype),
            seed=self.settings.train.seed,
            defer_grad_sync=self.defer_grad_sync,
        )

    def restore(self) -> RunState:
        """Resume per checkpoint.resume, or warm-start per checkpoint.load_weights, or start fresh."""
        ckpt = self.settings.checkpoint
        self.freeze.before_restore(self.optimizer)
        path = self.checkpointer.resume_path()
        if path is not None:
            state = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler, self.loader)
            self.freeze.after_resume(state.step)
            return state
        if ckpt.load_weights:
            self.checkpointer.load_weights(ckpt.load_weights, self.model, tuple(ckpt.load_weights_exclude))
        return RunState()

    def save_checkpoint(self) -> None:
        set_optimizer_mode(self.optimizer, "eval")  # schedule-free: save the averaged weights
        self.checkpointer.save(self.state.step, self.model, self.optimizer, self.scheduler, self.loader, self.state)
        set_optimizer_mode(self.optimizer, "train")

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Optimizer step `step` over grad_accum micro-batches; returns this rank's (loss sum, labelled tokens) and
        the grad norm, as tensors (`token_mean` of the first two is the step's loss: the loop reduces them over the
        dp ranks only when it logs). The loss is the mean over the global batch's labelled tokens, whatever the
        micro-batch size, accumulation and dp size (see the step bodies, forge.train.steps)."""
        train = self.settings.train
        self.freeze.before_step(step - 1)
        with self.meter.waiting_for_data():
            batches = [self.loader.next_batch() for _ in range(self.grad_accum)]
        loss_sum, tokens = self.step_body.forward_backward(batches, self.guard.loss_for(step, self.loss_fn))
        if self.replicas is not None:
            self.replicas.average_gradients(self.model)
        folded = self.step_body.count_folded  # the gradients wait for the step's token count, summed with the flags
        grad_norm = self.step_body.clip_grad_norm(0.0 if folded else train.grad_clip)
        rank_loss = loss_sum / tokens.clamp(min=1)  # this rank's mean, for the check and its message
        flags = self.guard.launch_check(step, rank_loss, grad_norm, tokens if folded else None, self.is_log_step(step))
        if folded:
            grad_norm = self.step_body.finish_token_mean(flags.world_tokens, grad_norm, train.grad_clip)
        finite, mask = True, None
        if self.masked_updates:  # no host sync: the last step's flags are read while this one's are in flight
            self.guard.settle(keep_newest=True)
            mask = self.guard.update_mask(flags)
        else:
            finite = self.guard.settle()
        committed = self.replicas is None or self.replicas.commit(step)  # every rank of the group asks
        if not committed:  # a lost peer group: the step is trained again, torchft's step count did not move
            self.optimizer.zero_grad(set_to_none=True)
            return loss_sum, tokens, grad_norm
        if finite:
            with applied_where(self.optimizer, mask):
                self.optimizer.step()
            # sigmoid routers: outside the gradient; the loads are summed over ranks only where needed
            update_router_biases(self.model, self.sum_loads, for_metrics=self.is_log_step(step), mask=mask)
            if self.float8_all_gather:
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(self.model)  # one all-reduce of all scales, not one each
        self.scheduler.step()
        for group in self.optimizer.param_groups:  # data phases may scale the next step's lr (mixture annealing)
            group["lr"] *= self.loader.lr_scale
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, tokens, grad_norm

    def is_log_step(self, step: int) -> bool:
        return step % self.settings.train.log_every == 0 or step == self.settings.train.steps

    def is_eval_step(self, step: int) -> bool:
        train = self.settings.train
        return bool(train.eval_every and step % train.eval_every == 0) or step == train.steps

    def reads_host(self, step: int) -> bool:
        """Steps the host waits for anyway (a log line, an evaluation, a checkpoint): the non-finite policy is
        applied to them at once; other steps' checks are read during the next step."""
        return (
            self.is_log_step(step)
            or self.is_eval_step(step)
            or self.checkpointer.should_save(step, self.settings.train.steps)
        )

    def skip_step(self) -> None:
        """Consume a step's batches without training on them (rolled-back offending batches)."""
        for _ in range(self.grad_accum):
            self.loader.next_batch()
        self.scheduler.step()

    def roll_back(self, bad_step: int) -> None:
        path = self.checkpointer.latest()
        if path is None:
            raise RuntimeError(f"step {bad_step} needs a rollback but no checkpoint has been written yet")
        self.optimizer.zero_grad(set_to_none=True)
        for _, layer in moe_layers(self.model):  # a rolled-back step's expert loads must not reach the replay
            layer.step_tally = None
        self.state = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler, self.loader)
        set_optimizer_mode(self.optimizer, "train")

    def finish(self, wall: float, loss: torch.Tensor, first_val: float, val_loss: float) -> dict:
        """After the last step: the pending checkpoint written, the save_hf export, the summary and its log line."""
        self.checkpointer.wait()
        if self.checkpointer.last_save_error:  # on_save_error=continue kept training; the run must not look whole
            raise CheckpointError(
                f"the run ended without its last checkpoint: {self.checkpointer.last_save_error}; the latest "
                f"checkpoint is {self.checkpointer.latest()}"
            )
        set_optimizer_mode(self.optimizer, "eval")  # leave the model at the weights that were evaluated and saved
        if not self.preempted:  # checkpoint.save_hf: the final weights as a Hugging Face folder (collective)
            save_run_hf(self.settings.checkpoint, self.run_dir, self.model, getattr(self.corpus, "tokenizer", None))
        self.metrics.close()
        summary = {
            "steps": self.state.step,
            "tokens": self.state.tokens_seen,
            "final_loss": loss.item(),
            "first_val_loss": first_val,
            "final_val_loss": val_loss,
            "wall_s": wall,
            "tokens_per_s": self.state.tokens_seen / max(wall, 1e-9),
            "params": self.n_params,
            "run_dir": str(self.run_dir),
            "preempted": self.preempted,
            "signal": self.guard.preemption.received,
        }
        log.info(
            "done: %d steps, %s tokens in %s (%s tok/s) | train loss %.4f | val loss %.4f -> %.4f | run dir %s",
            summary["steps"],
            f"{summary['tokens']:,}",
            format_duration(wall),
            f"{summary['tokens_per_s']:,.0f}",
            summary["final_loss"],
            first_val,
            val_loss,
            self.run_dir,
        )
        if self.owns_process_group:
            dist.teardown()
        return summary

    @contextlib.contextmanager
    def ending_cleanly(self):
        """The scope of `fit`: a failure closes the tracker runs as failed (a dead or stalled peer: one error naming
        it, exit 77); the watchdog, the signal handlers and the run lock end with it. The watchdog, a lost peer or
        an overdue preemption save end the process with os._exit: the tracker runs are closed with that exit code
        first (metrics.jsonl is flushed line by line anyway)."""
        forget_metrics_on_exit = on_hard_exit(self.metrics.close)
        try:
            yield
        except BaseException as err:  # dcp's CheckpointException is a BaseException
            self.guard.exit_if_peer_lost(err)
            try:
                self.metrics.close(exit_code=1)  # the tracker runs end as failed, not as running or finished
            except Exception as close_err:
                log.warning("could not close the metrics after the failure: %s", close_err)
            raise
        finally:
            forget_metrics_on_exit()
            self.guard.close()
            if self.replicas is not None:
                self.replicas.close()
            if self.run_lock is not None:
                self.run_lock.release()

    def warn_if_trained(self) -> None:
        if self.state.step >= self.settings.train.steps:
            log.warning(
                "the run resumed at step %d, which is not before train.steps=%d: nothing to train (raise train.steps "
                "to continue it)",
                self.state.step,
                self.settings.train.steps,
            )

    def log_step(self, step: int, lr: float, loss_sum, tokens, grad_norm) -> torch.Tensor:
        """The step's line: its loss (this rank's sums reduced over the dp ranks, the one collective a log step
        adds), lr, grad norm, throughput, data, guard and MoE metrics. Returns the loss."""
        loss = token_mean(loss_sum, tokens, self.mesh)
        self.metrics.log_train(
            step,
            {
                "loss": loss.item(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                **self.meter.interval(step, self.state.tokens_seen),
                "tokens_seen": self.state.tokens_seen,
                **self.loader.metrics(),
                **self.guard.metrics(),
                **(self.replicas.metrics() if self.replicas is not None else {}),
                **moe_metrics(self.model),
            },
        )
        return loss

    def log_preempted(self, step: int) -> None:
        received = self.guard.preemption.received
        log.warning(
            "%s (%s): checkpoint at step %d written; exiting with code %d",
            "interrupted" if received == "SIGINT" else "preempted",
            received or "a peer's signal",
            step,
            EXIT_INTERRUPTED if received == "SIGINT" else EXIT_PREEMPTED,
        )

    def evaluate(self) -> float:
        train = self.settings.train
        set_optimizer_mode(self.optimizer, "eval")  # schedule-free: evaluate the averaged weights
        batches = self.corpus.val_batches(
            train.seq_len, train.micro_batch_size, self.eval_micro_batches, self.dp_rank, self.dp_size
        )
        val_loss = token_mean(*self.step_body.evaluate(batches), self.mesh)
        set_optimizer_mode(self.optimizer, "train")
        return val_loss.item()

    def fit(self) -> dict:
        """Train to train.steps (or until preempted): the first evaluation, then each step trains, logs, evaluates
        and saves when due. The guard reads each step's non-finite and stop flags (`before_step`, `after_step`:
        skip a rolled-back step's batches, read the flags when the host waits anyway, stop on a signal)."""
        train = self.settings.train
        with self.ending_cleanly(), debug_modes(train.detect_anomaly, train.deterministic, self.device):
            self.warn_if_trained()
            self.model.train()
            first_val = val_loss = self.evaluate()
            if self.state.step == 0:
                self.metrics.log_eval(self.state.step, first_val)
            start = time.perf_counter()
            self.meter.restart(self.state.step, self.state.tokens_seen)
            loss = loss_sum = torch.full((), float("nan"))  # no step run: no training loss
            tokens = torch.ones(())
            while self.state.step < train.steps and not self.preempted:
                if self.replicas is not None:
                    self.replicas.start_step(self.state.step)  # a group behind takes a live group's state here
                    if self.state.step >= train.steps:
                        break
                step = self.state.step + 1
                lr = self.optimizer.param_groups[0]["lr"]  # includes a data phase's lr_scale
                self.profiler.step_started(step)
                try:
                    skipped = self.guard.before_step(step)
                    if skipped:  # a rolled-back step's offending batches
                        self.skip_step()
                    else:
                        loss_sum, tokens, grad_norm = self.train_step(step)
                        self.preempted = self.guard.after_step(step, self.reads_host(step), self.device)
                except RollbackRequested as rollback:
                    self.roll_back(rollback.step)
                    continue
                if self.replicas is not None and not self.replicas.committed:
                    self.stop_uncommitted()
                    continue
                self.state.step = step
                self.state.tokens_seen += self.tokens_per_step
                if skipped:
                    continue
                self.profiler.step_finished(step)
                if self.is_log_step(step):
                    loss = self.log_step(step, lr, loss_sum, tokens, grad_norm)
                if self.is_eval_step(step):
                    with self.meter.paused():
                        val_loss = self.evaluate()
                    self.metrics.log_eval(step, val_loss)
                self.checkpointer.poll()
                if self.preempted or self.checkpointer.should_save(step, train.steps):
                    with self.meter.paused():
                        self.save_checkpoint()
                if self.preempted:
                    self.log_preempted(step)
            self.guard.settle()  # none is left unread in practice (log and skipped steps read theirs); none dropped
            if self.preempted and not self.is_log_step(self.state.step):
                loss = token_mean(loss_sum, tokens, self.mesh)  # every rank stopped after this step
            return self.finish(time.perf_counter() - start, loss, first_val, val_loss)
