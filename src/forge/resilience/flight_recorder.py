"""torch's flight recorder: each rank keeps its last collectives (group, op, sizes, state, its stack), and a rank whose
watchdog or liveness check ends the job writes them into the run directory, so a hang says which collective each
rank was in. The files are the pickles torch's own dump on an NCCL timeout writes; read them with
`python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder --prefix rank_` (torchfrtrace).
Recorded on NCCL and gloo groups alike (torch 2.13), so a CPU job's hang explains itself too."""

import contextlib
import os
import threading
from pathlib import Path

import torch

from forge.files import temp_file

FOLDER = "flight_recorder"
BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch's switch for the recorder, read when a process group is made (the second, older name is NCCL's)."""
DUMP_TIMEOUT_S = 10.0
"""A rank that ends the job waits this long for its dump (a stuck filesystem must not keep a hung job alive)."""
ENABLED = False


def enable(entries: int) -> None:
    """Before the process group is made: keep the last `entries` collectives of each group (0: none). A size the
    environment already gives, under either name, wins."""
    global ENABLED
    if not any(name in os.environ for name in BUFFER_ENV):
        os.environ[BUFFER_ENV[0]] = str(entries)
    with contextlib.suppress(ValueError):
        ENABLED = int(os.environ.get(BUFFER_ENV[0], os.environ.get(BUFFER_ENV[1], "0"))) > 0


def dump(run_dir: Path, rank: int) -> Path | None:
    """This rank's recorded collectives to RUN_DIR/flight_recorder/rank_<rank>; the file, or None when the recorder
    is off or the dump fails (the job is ending: that must not stop it)."""
    if not ENABLED:
        return None
    folder, tmp = Path(run_dir) / FOLDER, None
    try:
        data = torch._C._distributed_c10d._dump_fr_trace()
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_file(folder, prefix=f".rank_{rank}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / f"rank_{rank}")
        return folder / f"rank_{rank}"
    except Exception:  # noqa: BLE001 - a failed dump is not worth a traceback on the way out
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return None


def dump_line(run_dir: Path | None, rank: int) -> str:
    """Dump this rank's recorder, waiting at most DUMP_TIMEOUT_S, and say where: "flight recorder: <file> ...", or
    "" (no run directory, recorder off, the dump failed or is late)."""
    if run_dir is None or not ENABLED:
        return ""
    written: list[Path | None] = [None]

    def write() -> None:
        written[0] = dump(run_dir, rank)

    thread = threading.Thread(target=write, daemon=True, name="forge-flight-recorder")
    thread.start()
    thread.join(DUMP_TIMEOUT_S)
    if written[0] is None:
        return ""
    return f"flight recorder: {written[0]} (each rank that ends the job writes its own)"
