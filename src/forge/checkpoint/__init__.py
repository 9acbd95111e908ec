"""Distributed checkpoints: save, seal, retain, resume; conversion to and from other formats."""

import warnings

from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.manager import Checkpointer, RunState

# A single process saves and loads with no_dist=True on purpose; DCP warns about it at every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

__all__ = ["CheckpointError", "Checkpointer", "RunState"]
