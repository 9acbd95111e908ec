"""The training loop: data, forward/backward/step, eval, metrics."""

import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from forge.checkpoint import Checkpointer, RunState
from forge.config import validate
from forge.data.loader import TokenWindows, eval_batches
from forge.metrics import MetricsLogger
from forge.metrics.logger import format_duration
from forge.train import build
from forge.train.precision import autocast, resolve_dtype

log = logging.getLogger("forge")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (labels of -100 are ignored)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


@torch.no_grad()
def evaluate(model: nn.Module, batches, device: torch.device, dtype: str) -> float:
    """Mean loss over the given (inputs, labels) batches."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for inputs, labels in batches:
        with autocast(device, dtype):
            logits = model(inputs.to(device))
        total += cross_entropy(logits, labels.to(device))
        count += 1
    model.train(was_training)
    return (total / max(count, 1)).item()


class Trainer:
    """Builds every piece from the composed config, then runs the loop."""

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.degrees = validate(cfg)
        train = cfg.train
        if train.threads > 0:
            torch.set_num_threads(train.threads)
        torch.manual_seed(train.seed)
        self.device = build.resolve_device(train.device)
        self.dtype = resolve_dtype(train.dtype, self.device)
        self.dp_rank, self.dp_size = 0, self.degrees.dp

        self.corpus = build.build_corpus(cfg)
        self.model = build.build_meta_model(cfg)
        build.materialize(self.model, self.device, train.seed)
        self.optimizer, self.scheduler = build.build_optimizer(cfg, self.model)
        self.loader = build.build_loader(cfg, self.corpus.train_tokens, self.dp_rank, self.dp_size)
        self.val_windows = TokenWindows(self.corpus.val_tokens, train.seq_len)
        self.grad_accum = train.global_batch_size // (train.micro_batch_size * self.dp_size)
        self.tokens_per_step = train.global_batch_size * train.seq_len
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, build.config_yaml(cfg))
        self.state = self.restore()
        self.metrics = MetricsLogger(self.run_dir, train.steps, cfg.metrics.console, cfg.metrics.smoothing)
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info(
            "model %.2fM parameters | %d steps x %d tokens | grad accum %d | device %s | %s",
            n_params / 1e6,
            train.steps,
            self.tokens_per_step,
            self.grad_accum,
            self.device,
            self.dtype,
        )
        self.n_params = n_params

    def restore(self) -> RunState:
        """Resume per checkpoint.resume, or warm-start per checkpoint.load_weights, or start fresh."""
        ckpt = self.cfg.checkpoint
        path = self.checkpointer.resume_path()
        if path is not None:
            return self.checkpointer.load(path, self.model, self.optimizer, self.scheduler, self.loader)
        if ckpt.load_weights:
            self.checkpointer.load_weights(ckpt.load_weights, self.model, tuple(ckpt.load_weights_exclude))
        return RunState()

    def save_checkpoint(self) -> None:
        self.checkpointer.save(self.state.step, self.model, self.optimizer, self.scheduler, self.loader, self.state)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches; returns (mean loss, grad norm) as tensors."""
        train = self.cfg.train
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum):
            inputs, labels = self.loader.next_batch()
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            with autocast(self.device, self.dtype):
                logits = self.model(inputs)
            loss = cross_entropy(logits, labels)
            (loss / self.grad_accum).backward()
            loss_sum += loss.detach()
        max_norm = train.grad_clip if train.grad_clip > 0 else math.inf
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / self.grad_accum, grad_norm

    def evaluate(self) -> float:
        train = self.cfg.train
        batches = eval_batches(self.val_windows, train.micro_batch_size, train.eval_batches, self.dp_rank, self.dp_size)
        return evaluate(self.model, batches, self.device, self.dtype)

    def fit(self) -> dict:
        train = self.cfg.train
        self.model.train()
        first_val = val_loss = self.evaluate()
        if self.state.step == 0:
            self.metrics.log_eval(self.state.step, first_val)
        start = last_time = time.perf_counter()
        last_tokens = self.state.tokens_seen
        loss = torch.zeros(())
        while self.state.step < train.steps:
            lr = self.scheduler.get_last_lr()[0]
            loss, grad_norm = self.train_step()
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            step = self.state.step
            if step % train.log_every == 0 or step == train.steps:
                now = time.perf_counter()
                elapsed, last_time = now - last_time, now
                tokens, last_tokens = self.state.tokens_seen - last_tokens, self.state.tokens_seen
                self.metrics.log_train(
                    step,
                    {
                        "loss": loss.item(),
                        "lr": lr,
                        "grad_norm": grad_norm.item(),
                        "tokens_per_s": tokens / elapsed,
                        "step_time": elapsed * self.tokens_per_step / max(tokens, 1),
                        "tokens_seen": self.state.tokens_seen,
                    },
                )
            if (train.eval_every and step % train.eval_every == 0) or step == train.steps:
                val_loss = self.evaluate()
                self.metrics.log_eval(step, val_loss)
            self.checkpointer.poll()
            if self.checkpointer.should_save(step, train.steps):
                self.save_checkpoint()
        self.checkpointer.wait()
        wall = time.perf_counter() - start
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
        return summary
