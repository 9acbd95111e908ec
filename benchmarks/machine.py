"""What every benchmark states about the machine it ran on, and an older commit to run beside this checkout."""

import contextlib
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> str:
    """The CPU's native-bf16 flags (`grep -o 'avx512_bf16\\|amx_bf16' /proc/cpuinfo | sort -u`), or "none"."""
    path = Path("/proc/cpuinfo")
    words = set(path.read_text().split()) if path.exists() else set()
    return " ".join(flag for flag in BF16_FLAGS if flag in words) or "none"


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work before a clock is read: CUDA's synchronize, or nothing on a CPU."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def gpu_note(device: torch.device) -> str:
    """ " | <GPU name>" for a CUDA device, to follow the CPU flags in a benchmark's first line; else ""."""
    return f" | {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""


@contextlib.contextmanager
def commit_src(commit: str) -> Iterator[Path]:
    """The src/ folder of `commit`, checked out in a temporary git worktree (put it first on PYTHONPATH)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / commit
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        try:
            yield tree / "src"
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
