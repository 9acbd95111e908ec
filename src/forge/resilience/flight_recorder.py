"""torch's flight recorder: each rank keeps its last collectives (group, op, sizes, state, its stack), and a rank whose
watchdog or liveness check ends the job writes them into the run directory, so a hang says which collective each
rank was in. The files are the pickles torch's own dump on an NCCL timeout writes; read them with
`python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder --prefix rank_` (torchfrtrace).
Recorded on NCCL and gloo groups alike (torch 2.13), so a CPU job's hang explains itself too."""

import os
from pathlib import Path

import torch

from forge.files import temp_file

FOLDER = "flight_recorder"
BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch's switch for the recorder, read when a process group is made (the second, older name is NCCL's)."""


def enable(entries: int) -> None:
    """Before the process group is made: keep the last `entries` collectives of each group (0: off). A value the
    environment already sets wins."""
    if entries > 0:
        for name in BUFFER_ENV:
            os.environ.setdefault(name, str(entries))


def dump(run_dir: Path, rank: int) -> Path | None:
    """This rank's recorded collectives to RUN_DIR/flight_recorder/rank_<rank>; the file, or None when the recorder
    is off or the dump fails (the job is ending: that must not stop it)."""
    if int(os.environ.get(BUFFER_ENV[0], os.environ.get(BUFFER_ENV[1], "0")) or 0) <= 0:
        return None
    try:
        data = torch._C._distributed_c10d._dump_fr_trace()
        folder = Path(run_dir) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_file(folder, prefix=f".rank_{rank}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / f"rank_{rank}")
        return folder / f"rank_{rank}"
    except Exception:  # noqa: BLE001 - a failed dump is not worth a traceback on the way out
        return None


def dump_line(run_dir: Path | None, rank: int) -> str:
    """ " Flight recorder: <file>." after dumping, or "" (no run directory, recorder off, dump failed)."""
    written = dump(run_dir, rank) if run_dir is not None else None
    return f" Flight recorder: {written} (every rank that stops so writes its own)." if written else ""
