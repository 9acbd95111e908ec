"""Distributed checkpoints: save, seal, retain, resume; conversion to and from other formats."""

from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.manager import Checkpointer, RunState

__all__ = ["CheckpointError", "Checkpointer", "RunState"]
