"""A device health check at start-up: fail fast on a broken accelerator instead of hanging later."""

import logging

import torch

from forge.parallel.env import read_dist_env

log = logging.getLogger("forge")


class DeviceUnhealthyError(RuntimeError):
    """The device could not allocate memory or multiply two small matrices correctly."""


def device_to_check(device: torch.device) -> torch.device:
    """The device this rank will use: an unnumbered cuda device means the local rank's GPU, as under torchrun.

    The check runs before the process group exists; without the index every rank would test (and create a
    context on) GPU 0.
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", read_dist_env().local_rank)
    return device


def check_device(device: torch.device, size: int = 256, alloc_mib: int = 32) -> None:
    """Allocate and read back alloc_mib MiB on the device, and compare a small matmul with the CPU result."""
    device = device_to_check(device)
    try:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            log.debug("device %s: %.1f of %.1f GiB free", device, free / 2**30, total / 2**30)
        block = torch.ones(alloc_mib * 2**20 // 4, device=device)  # fp32: alloc_mib MiB
        filled = int(block.sum().item())
        del block
        a = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
        b = torch.randn(size, size, generator=torch.Generator().manual_seed(1))
        expected = a @ b
        got = (a.to(device) @ b.to(device)).cpu()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - any failure here means the device is unusable
        raise DeviceUnhealthyError(f"device {device} failed the start-up check: {err}") from err
    if filled != alloc_mib * 2**20 // 4:
        raise DeviceUnhealthyError(f"device {device} read back a wrong sum from a {alloc_mib} MiB block of ones")
    if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2):
        raise DeviceUnhealthyError(f"device {device} computed a wrong {size}x{size} matmul in the start-up check")
    log.debug("device %s passed the start-up health check", device)
