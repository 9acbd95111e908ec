"""Resume a run from a checkpoint in some parallel layout, dump the restored state, then train on.

    torchrun --standalone --nproc-per-node N -m tests.checkpoint.layout_worker RUN_DIR DUMP_DIR OVERRIDE...

Right after the Trainer restored the checkpoint (before any step), every rank writes DUMP_DIR/rank{r}.pt: what the
parallel plan did (`describe`), and the model and optimizer state as full (unsharded)
tensors of the parameters this rank holds, through the same `get_state_dict` API and whole-model names the
checkpointer uses. A pipeline stage holds only its own parameters; the test merges the ranks' files.
"""

import faulthandler
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from forge.checkpoint.stages import rename, whole_model_names
from forge.config import compose
from forge.parallel.dist import rank
from forge.train.trainer import Trainer

HANG_TIMEOUT_S = 300
"""A hang prints every thread's stack and ends the process instead of stalling the test."""


def describe(trainer: Trainer) -> dict:
    """The blocks this rank holds and str() of the placements of its first block's attention.wq.weight."""
    parts = list(trainer.model) if isinstance(trainer.model, nn.ModuleList) else [trainer.model]
    blocks = sorted(int(key) for part in parts for key in part.layers)
    wq = parts[0].layers[str(min(int(key) for key in parts[0].layers))].attention.wq.weight
    return {"blocks": blocks, "placements": [str(p) for p in getattr(wq, "placements", ())]}


def resume(run_dir: str, dump_dir: str, overrides: list[str]) -> None:
    faulthandler.dump_traceback_later(HANG_TIMEOUT_S, exit=True)
    try:
        trainer = Trainer(compose(overrides), Path(run_dir))
        plan = describe(trainer)
        model_sd, optim_sd = get_state_dict(
            trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True)
        )
        model_sd, optim_sd = rename(model_sd, optim_sd, whole_model_names(trainer.model, model_sd))
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        torch.save(
            {"step": trainer.state.step, "layout": plan, "model": model_sd, "optim": optim_sd},
            Path(dump_dir) / f"rank{rank()}.pt",
        )
        trainer.fit()
    finally:
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    resume(sys.argv[1], sys.argv[2], sys.argv[3:])
