"""Freeze schedules: which parts of the model train at each step, applied around the loop.

A VLM's vision tower and decoder can each wait frozen until a step (vlm.train_encoder_from_step,
vlm.train_decoder_from_step). The model holds the schedule and its state (buffers saved with the weights); the
trainer asks its `freeze` to prepare the optimizer before a restore, to check a resumed state, and to apply the
schedule before every step. A text model trains whole from the first step: `Unfrozen` does nothing.
"""

import logging

import torch
from torch import nn

log = logging.getLogger("forge")


class Unfrozen:
    """Every parameter trains at every step."""

    def before_restore(self, optimizer: torch.optim.Optimizer) -> None: ...

    def after_resume(self, step: int) -> None: ...

    def before_step(self, step: int) -> None: ...


class FreezeSchedule:
    """The freeze schedule of a VisionLanguageModel (`schedule_at`, `set_step`, `check_freeze_state`).

    Built before the optimizer: everything the schedule ever trains is then marked trainable, so that it goes into
    the optimizer, and `before_step` freezes what waits (a vision tower the schedule never trains stays out).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        for param in model.parameters():
            param.requires_grad_(True)
        if model.train_encoder_from_step is None:
            for param in model.encoder.parameters():
                param.requires_grad_(False)

    def before_restore(self, optimizer: torch.optim.Optimizer) -> None:
        fill_empty_adam_state(optimizer)

    def after_resume(self, step: int) -> None:
        """The saved freeze state must be this config's schedule at `step` (else a ValueError naming the options)."""
        if step:
            self.model.check_freeze_state(step)

    def before_step(self, step: int) -> None:
        """Apply the schedule for the optimizer step after `step` steps; a change is logged."""
        if self.model.set_step(step):
            enc, dec = self.model.schedule_at(step)
            log.info(
                "step %d: vision tower %s, decoder %s",
                step + 1,
                "trained" if enc else "frozen",
                "trained" if dec else "frozen",
            )


def fill_empty_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter Adam's initial state (step 0, zero moments) now, as Adam would lazily on its first
    step. Parameters the freeze schedule trains later then have a state in every checkpoint, so a checkpoint
    written before they start training loads into a fresh optimizer (DCP needs the same keys on both sides)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
