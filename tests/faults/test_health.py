import pytest
import torch

from forge.resilience.health import DeviceUnhealthyError, check_device, device_to_check


def test_cpu_passes_the_health_check():
    check_device(torch.device("cpu"))


def test_a_wrong_matmul_is_reported(monkeypatch):
    real = torch.Tensor.__matmul__
    calls = {"n": 0}

    def broken(a, b):
        calls["n"] += 1
        out = real(a, b)
        return out if calls["n"] == 1 else out + 1.0  # the "device" result is off

    monkeypatch.setattr(torch.Tensor, "__matmul__", broken)
    with pytest.raises(DeviceUnhealthyError, match="wrong 256x256 matmul"):
        check_device(torch.device("cpu"))


def test_an_unavailable_device_is_reported():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(DeviceUnhealthyError, match="cuda"):
        check_device(torch.device("cuda"))


def test_an_unnumbered_gpu_means_the_local_ranks_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert device_to_check(torch.device("cuda")) == torch.device("cuda", 1)
    assert device_to_check(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert device_to_check(torch.device("cpu")) == torch.device("cpu")


def test_a_wrong_read_back_is_reported(monkeypatch):
    real = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: real(t, *a, **k) - 1)  # one bad word
    with pytest.raises(DeviceUnhealthyError, match="wrong sum from a 32 MiB block"):
        check_device(torch.device("cpu"))
