"""Step time, data wait, MFU and memory of a log interval."""

import json
import logging
import time

import pytest
import torch

from forge.metrics.meter import StepMeter, describe_peak
from forge.planning.peak import Peak, device_name, resolve_peak


def test_interval_leaves_out_paused_time_and_reports_data_wait():
    meter = StepMeter(torch.device("cpu"), flops_per_token=1e6, peak=Peak(1e9, "test"), world_size=2)
    meter.restart(step=10, tokens_seen=1000)
    for _ in range(2):
        with meter.waiting_for_data():
            time.sleep(0.02)
        time.sleep(0.03)
    with meter.paused():
        time.sleep(0.2)
    m = meter.interval(step=12, tokens_seen=1200)
    assert m["step_time"] == pytest.approx(0.05, abs=0.02)
    assert m["data_wait"] == pytest.approx(0.02, abs=0.01)
    assert m["tokens_per_s"] == pytest.approx(200 / (2 * m["step_time"]), rel=1e-6)
    assert m["mfu"] == pytest.approx(1e6 * m["tokens_per_s"] / 2 / 1e9, rel=1e-6)
    assert m["mem_rss_gib"] > 0.01 and m["mem_rss_peak_gib"] >= m["mem_rss_gib"] * 0.99
    # The next interval starts where this one ended.
    assert meter.interval(step=13, tokens_seen=1300)["data_wait"] < 0.01


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_unknown_peak_leaves_mfu_out_and_says_so():
    meter = StepMeter(torch.device("cpu"), flops_per_token=1e6, peak=Peak(None, "unknown for X"))
    assert "mfu" not in meter.interval(step=1, tokens_seen=10)
    logger, lines = logging.getLogger("forge"), Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        describe_peak(1e6, Peak(None, "unknown for X"))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert lines.lines == ["MFU not reported: peak FLOP/s unknown for X"]


def test_a_cached_peak_below_the_run_s_rate_is_measured_again(tmp_path, monkeypatch):
    """A peak cached while another job loaded the machine made MFU read over 100 %: the meter measures again."""
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path))
    device = torch.device("cpu")
    key = f"{device_name(device)}|fp32|threads={torch.get_num_threads()}|v2"
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: 1.0}))  # 1 FLOP/s: any run is faster
    peak = resolve_peak(device, "fp32")
    assert peak.flops == 1.0 and peak.source.startswith("cached")
    meter = StepMeter(device, flops_per_token=1e6, peak=peak)
    meter.restart(step=0, tokens_seen=0)
    time.sleep(0.01)
    logger, lines = logging.getLogger("forge"), Lines()
    logger.addHandler(lines)
    try:
        m = meter.interval(step=1, tokens_seen=100)
    finally:
        logger.removeHandler(lines)
    assert any("measuring the peak again" in line for line in lines.lines), lines.lines
    remeasured = json.loads((tmp_path / "peak_flops.json").read_text())[key]
    assert remeasured > 1e6 and meter.peak.flops == remeasured and meter.peak.remeasure is None
    assert m["mfu"] == pytest.approx(1e6 * m["tokens_per_s"] / remeasured, rel=1e-6)
    again = resolve_peak(device, "fp32")  # the next run: measured again once a day is enough for this cache entry
    assert again.flops == remeasured and again.source.startswith("cached") and again.remeasure is None
    cache = json.loads((tmp_path / "peak_flops.json").read_text())
    cache[f"{key}|measured again"] -= 25 * 3600  # a day later
    (tmp_path / "peak_flops.json").write_text(json.dumps(cache))
    assert resolve_peak(device, "fp32").remeasure is not None
