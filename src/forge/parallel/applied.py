"""What the parallel plan applied: one record per transform, in the order applied.

`parallelize` returns these and `forge-train --plan` prints them; the same sentence also goes to the log, but
nothing reads the log back.
"""

import logging
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger("forge")

Step = Literal[
    "pp", "tp", "cp", "router_counts", "ep", "router_loads", "fp8", "activation_checkpoint", "compile", "expert_fsdp",
    "fsdp",
]  # fmt: skip


@dataclass(frozen=True)
class Applied:
    """One transform applied to a model (or a pipeline stage of it)."""

    step: Step
    """Which transform: pipeline split or schedule, tensor parallel, context parallel, the MoE counts summed over
    it, expert parallel, global-batch router loads, float8, activation checkpointing, per-block compile, FSDP2 of the
    experts, FSDP2 (FSDP, HSDP or DDP)."""
    detail: str
    """What it covered (modules, mesh, dtypes), in the sentence the report prints."""
    mesh: dict[str, int] = field(default_factory=dict)
    """The mesh dimensions it spans and their sizes; empty for a transform local to each rank."""

    def __str__(self) -> str:
        return self.detail


def logged(applied: Applied) -> Applied:
    """`applied`, after logging its sentence at INFO (the record carries the step as `plan_step`)."""
    log.info("%s", applied.detail, extra={"plan_step": applied.step})
    return applied
