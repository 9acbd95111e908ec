"""A real short run: speed, MFU and memory fields, profiler files, quiet console, MLflow resume, forge-plot."""

import json
import logging
import struct

import pytest
from mlflow.tracking import MlflowClient

from forge.config import compose
from forge.metrics import MetricsLogger
from forge.metrics.plot import main as forge_plot
from forge.train.trainer import Trainer
from tests.tiny import TINY_MODEL

TINY = [
    *TINY_MODEL,
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.dtype=fp32",
    "train.log_every=5",
    "train.eval_every=0",
    "train.eval_batches=2",
    "scheduler.warmup_steps=2",
]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    overrides = [
        "train.steps=6",
        "train.log_every=3",
        "metrics.profile_start_step=2",
        "metrics.profile_end_step=3",
        "metrics.memory_snapshot=true",
    ]
    Trainer(compose([*TINY, *overrides]), run_dir).fit()
    return run_dir


def test_each_log_step_has_speed_mfu_and_memory(run_dir):
    train = [r for r in records(run_dir) if "loss" in r]
    assert [r["step"] for r in train] == [3, 6]
    for r in train:
        assert r["step_time"] > 0 and 0 <= r["data_wait"] < r["step_time"]
        assert r["tokens_per_s"] == pytest.approx(8 * 64 / r["step_time"], rel=1e-6)
        assert 0 < r["mfu"] < 1.5  # the measured CPU peak is a best-of-bursts, so a busy machine can beat it a bit
        assert r["mem_rss_gib"] > 0.05


def test_profiler_writes_a_chrome_trace_and_a_summary(run_dir):
    trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert len(trace["traceEvents"]) > 100
    assert "aten::mm" in names
    assert "Self CPU" in (run_dir / "profile" / "summary_rank0.txt").read_text()
    assert not list((run_dir / "profile").glob("memory_snapshot*"))  # CPU: only a log line


def png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_forge_plot_renders_one_run_and_a_sweep(run_dir, tmp_path):
    assert forge_plot([str(run_dir)]) == 0
    assert png_size(run_dir / "metrics.png") == (1200, 360)
    sweep = tmp_path / "multirun"
    for i in range(2):
        (sweep / str(i)).mkdir(parents=True)
        (sweep / str(i) / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    out = tmp_path / "sweep.png"
    assert forge_plot([str(sweep), "-o", str(out), "--dpi", "50"]) == 0
    assert png_size(out) == (600, 180) and out.stat().st_size > 5000


def test_quiet_console_prints_no_step_lines(tmp_path):
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger, level = logging.getLogger("forge"), logging.getLogger("forge").level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for console in ("quiet", "line"):
            metrics = MetricsLogger(tmp_path / console, 10, console=console)
            metrics.log_train(1, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "step_time": 0.1})
            metrics.log_eval(1, 2.0)
            metrics.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert len(lines) == 2 and "1/10 | loss 2.0000" in lines[0] and "step 0.100s" in lines[0]
    with pytest.raises(ValueError, match="loud"):
        MetricsLogger(tmp_path / "x", 10, console="loud")


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    common = [*TINY, "metrics=mlflow", "checkpoint.interval=3", "metrics.peak_tflops=1.0"]
    Trainer(compose([*common, "train.steps=3"]), tmp_path).fit()
    Trainer(compose([*common, "train.steps=5"]), tmp_path).fit()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "forge"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [3, 5]


def test_forge_plot_skips_a_last_line_cut_by_a_kill_and_names_a_bad_line_before_it(tmp_path, capsys, caplog):
    """A run killed while writing metrics.jsonl used to make forge-plot end in a JSONDecodeError traceback."""
    good = [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "tokens_per_s": 100.0} for s in (1, 2)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="forge"):
        assert forge_plot([str(tmp_path)]) == 0
    assert png_size(tmp_path / "metrics.png") == (1200, 360)
    assert [r.getMessage() for r in caplog.records] == [
        f"forge-plot: warning: {metrics}:3: last line cut short (Unterminated string starting at), skipped"
    ]
    metrics.write_text('{"step": 1, "lo\n' + json.dumps(good[1]) + "\n")
    assert forge_plot([str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"forge-plot: {metrics}:1: not a JSON line (Unterminated string starting at)\n"
