"""A device health check at start-up: fail fast on a broken accelerator instead of hanging later."""

import logging

import torch

log = logging.getLogger("forge")


class DeviceUnhealthyError(RuntimeError):
    """The device could not allocate memory or multiply two small matrices correctly."""


def check_device(device: torch.device, size: int = 256) -> None:
    """Allocate on the device and compare a small matmul with the CPU result."""
    try:
        a = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
        b = torch.randn(size, size, generator=torch.Generator().manual_seed(1))
        expected = a @ b
        got = (a.to(device) @ b.to(device)).cpu()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - any failure here means the device is unusable
        raise DeviceUnhealthyError(f"device {device} failed the start-up check: {err}") from err
    if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2):
        raise DeviceUnhealthyError(f"device {device} computed a wrong 256x256 matmul in the start-up check")
    log.debug("device %s passed the start-up health check", device)
