"""Peak FLOP/s: the device table, the measured and cached CPU peak, and an unknown peak said out loud."""

import json

import pytest
import torch

from forge.planning import peak as peak_module
from forge.planning.peak import TFLOPS, measure_matmul_flops, resolve_peak, table_peak


@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA L40S", "bf16", 362.1),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_table_by_device_name(name, dtype, tflops):
    assert table_peak(name, dtype) == pytest.approx(tflops * TFLOPS)


def test_fp32_reads_tf32_only_when_torch_allows_it():
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert table_peak("NVIDIA A100-SXM4-40GB", "fp32") == pytest.approx(19.5 * TFLOPS)
        matmul.allow_tf32 = True
        assert table_peak("NVIDIA A100-SXM4-40GB", "fp32") == pytest.approx(156.0 * TFLOPS)
    finally:
        matmul.allow_tf32 = before


def test_unknown_device_is_not_in_the_table():
    assert table_peak("Some Future GPU", "bf16") is None


def test_cpu_peak_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(device, dtype, size=1024, seconds=0.3):
        calls.append(dtype)
        return 1.5e11

    monkeypatch.setattr(peak_module, "measure_matmul_flops", fake_measure)
    monkeypatch.setattr(peak_module, "matmul_size_for", lambda device, dtype: 256)
    first = resolve_peak(torch.device("cpu"), "fp32")
    second = resolve_peak(torch.device("cpu"), "fp32")
    assert first.flops == second.flops == 1.5e11
    assert first.source.startswith("measured") and second.source.startswith("cached")
    assert calls == ["fp32"]
    cache = json.loads((tmp_path / "peak_flops.json").read_text())
    (key,) = cache
    assert key.endswith(f"|fp32|threads={torch.get_num_threads()}|v2")


def test_measured_size_stops_where_a_product_gets_slow():
    """fp32 on this CPU grows past the smallest size; a budget no product meets keeps the smallest."""
    assert peak_module.matmul_size_for(torch.device("cpu"), "fp32", largest=1024, budget_s=10.0) == 1024
    assert peak_module.matmul_size_for(torch.device("cpu"), "fp32", largest=1024, budget_s=0.0) == 256


def test_real_matmul_measurement_is_plausible():
    flops = measure_matmul_flops(torch.device("cpu"), "fp32", size=256, seconds=0.05)
    assert 1e8 < flops < 1e14


def test_unknown_peak_without_measuring_says_so_and_override_wins():
    unknown = resolve_peak(torch.device("cpu"), "fp32", measure=False)
    assert unknown.flops is None and "unknown" in unknown.source
    given = resolve_peak(torch.device("cpu"), "fp32", override_tflops=2.0)
    assert given.flops == 2.0 * TFLOPS and "config" in given.source
