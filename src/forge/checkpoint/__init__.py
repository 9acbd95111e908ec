"""Distributed checkpoints: save, seal, retain, resume; conversion to and from other formats.

Checkpointer and RunState are imported on first use: the config's validation reads forge.checkpoint.layout's
limits before torch is imported."""

import warnings

from forge.checkpoint.errors import CheckpointError
from forge.lazy import lazy_exports

# A single process saves and loads with no_dist=True on purpose; DCP warns about it at every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

__all__ = ["CheckpointError", "Checkpointer", "RunState"]
__getattr__ = lazy_exports(__name__, {name: "forge.checkpoint.manager" for name in ("Checkpointer", "RunState")})
