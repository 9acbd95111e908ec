"""Peak FLOP/s of one device: a table of accelerators, or a short matmul measured (and cached) elsewhere.

Table values are the vendors' dense (no structured sparsity) tensor-core numbers per device. fp32 training on
CUDA runs its matmuls as TF32 when torch allows it (`torch.backends.cuda.matmul.allow_tf32`), so fp32 reads the
tf32 column then, and the plain fp32 column otherwise.
"""

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("forge")

TFLOPS = 1e12

# Device-name substring -> dense TFLOP/s by dtype. More specific names come first (H100 PCIe before H100).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("B200", {"bf16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("MI300X", {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]


@dataclass
class Peak:
    """Peak FLOP/s of one device and where the number comes from."""

    flops: float | None
    """FLOP/s, or None when unknown (MFU is then not reported)."""
    source: str
    """table, measured, cached measurement, config, or why it is unknown."""
    remeasure: Callable[[], "Peak"] | None = None
    """For a cached measurement: measure again and raise the cache entry (the meter calls it when a run goes
    faster than the cached peak, which was then measured while something else ran)."""


def table_peak(device_name: str, dtype: str) -> float | None:
    """FLOP/s from the table for a device name like 'NVIDIA H100 80GB HBM3', or None."""
    for key, by_dtype in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            column = "tf32" if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32 else dtype
            value = by_dtype.get(column)
            return None if value is None else value * TFLOPS
    return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    return Path(os.environ.get("FORGE_CACHE_DIR", Path.home() / ".cache" / "forge"))


def measure_matmul_flops(device: torch.device, dtype: str, size: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of repeated square matmuls (best of a few timed bursts) in `dtype` on `device`."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device, torch_dtype)
    b = torch.randn(size, size, generator=gen).to(device, torch_dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b  # warm-up
    sync()
    best, deadline, reps = 0.0, time.perf_counter() + seconds, 1
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        elapsed = time.perf_counter() - start
        best = max(best, 2 * size**3 * reps / elapsed)
        if elapsed < 0.02:
            reps *= 2
    return best


def matmul_size_for(device: torch.device, dtype: str, largest: int = 2048, budget_s: float = 0.25) -> int:
    """The largest square size up to `largest` whose product takes under `budget_s`: small matrices understate a
    fast device, and large ones take minutes where the dtype is emulated (bf16 on a CPU without AVX512-BF16)."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    size = 256
    warm = torch.ones(size, size, device=device, dtype=torch_dtype)
    warm @ warm  # library handles, thread pools and lazy loading stay out of the timed products
    while size < largest:
        a = torch.ones(size * 2, size * 2, device=device, dtype=torch_dtype)
        start = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if time.perf_counter() - start > budget_s:
            break
        size *= 2
    return size


MEASURE_AGAIN_AFTER_S = 24 * 3600
"""A cached peak that a run outpaced is measured again at most this often (seconds)."""


def measured_peak(device: torch.device, dtype: str, name: str, refresh: bool = False) -> Peak:
    """A measured peak, cached in FORGE_CACHE_DIR/peak_flops.json by device model, dtype and threads; `refresh`
    measures again and caches the higher of the two.

    A cached peak is offered for one measurement again (a run faster than it asks for it), at most once a day per
    cache entry: where the run's mix of kernels beats the square matmul itself (bf16 emulated on a CPU without
    AVX512-BF16, where the model's fp32 parts run faster), measuring again cannot raise it, and every run would
    otherwise spend seconds finding that out; a day later it may, if the measurement again ran on a loaded
    machine."""
    key = f"{name}|{dtype}|threads={torch.get_num_threads()}|v2"
    measured_again = f"{key}|measured again"
    path = cache_dir() / "peak_flops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache and not refresh:
        recent = time.time() - cache.get(measured_again, 0.0) < MEASURE_AGAIN_AFTER_S
        again = None if recent else (lambda: measured_peak(device, dtype, name, True))
        return Peak(cache[key], f"cached measurement ({key})", again)
    flops = measure_matmul_flops(device, dtype, matmul_size_for(device, dtype), seconds=0.6)
    flops = max(flops, cache.get(key, 0.0))  # a measurement again (refresh) never lowers the cached peak
    cache[key] = flops
    if refresh:
        cache[measured_again] = time.time()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as err:
        log.warning("could not cache the measured peak in %s: %s", path, err)
    return Peak(flops, f"measured ({key})")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def resolve_peak(device: torch.device, dtype: str, override_tflops: float | None = None, measure: bool = True) -> Peak:
    """Peak FLOP/s of `device` in `dtype`: the config's override, the table, or a measurement (CPU/unknown)."""
    if override_tflops:
        return Peak(override_tflops * TFLOPS, "config (metrics.peak_tflops)")
    name = device_name(device)
    if device.type == "cuda":
        flops = table_peak(name, dtype)
        if flops is not None:
            return Peak(flops, f"table ({name}, {dtype})")
    if not measure:
        return Peak(None, f"unknown for {name} ({dtype}) and metrics.measure_peak=false")
    return measured_peak(device, dtype, name)
