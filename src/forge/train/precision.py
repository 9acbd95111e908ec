"""Compute dtype: bf16 autocast where the hardware has fast bf16 matmuls, else fp32."""

import functools
from contextlib import nullcontext
from pathlib import Path

import torch

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX); without them bf16 GEMMs are emulated
    and run tens of times slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def resolve_dtype(name: str, device: torch.device) -> str:
    """auto -> bf16 on CUDA and on CPUs with native bf16, else fp32; bf16 and fp32 are taken as given."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def autocast(device: torch.device, dtype: str):
    """The autocast context of a resolved dtype."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
