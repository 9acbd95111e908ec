"""benchmarks/gpu.sh on a CPU (DRY_RUN=1): every row composes, and the layout search's prediction for row 1 is
printed; the prediction's reading of a run's metrics.jsonl (the records after the first) checked on its own."""

import json
import os
import subprocess
import sys

import pytest
from benchmarks.search.predict_one_gpu import prediction_line

from tests.conftest import ROOT

ROW_1 = ["model=llama3_1b", "train.dtype=bf16", "train.seq_len=2048", "train.micro_batch_size=8",
         "train.global_batch_size=8"]  # fmt: skip


def test_the_gpu_script_composes_every_row_and_predicts_row_1(tmp_path):
    env = os.environ | {"DRY_RUN": "1", "OUT_DIR": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("composed: exit 0") == 7, proc.stdout
    assert "search prediction (h200, one GPU):" in (tmp_path / "search_prediction.txt").read_text()


def test_the_prediction_is_set_beside_the_steps_after_the_first(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 10, "step_time": 9.0}, {"step": 20, "step_time": 0.2}, {"step": 30, "step_time": 0.4}, {}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    alone = prediction_line(ROW_1, tmp_path / "absent.jsonl")
    predicted = float(alone.split(": ")[1].split(" s/step")[0])
    line = prediction_line(ROW_1, metrics)
    assert line.startswith(alone) and "measured 0.300 s/step" in line
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(predicted / 0.3, abs=0.01)


def test_skip_leaves_out_the_steps_it_names(tmp_path):
    env = os.environ | {"DRY_RUN": "1", "OUT_DIR": str(tmp_path), "PYTHON": sys.executable,
                        "SKIP": "small_compile moe_bf16"}  # fmt: skip
    proc = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("composed: exit 0") == 5, proc.stdout
    for name in ("small_compile", "moe_bf16"):
        assert f"=== {name}: skipped (SKIP)" in proc.stdout and not (tmp_path / f"{name}.cfg.yaml").exists()
    assert (tmp_path / "small_cuda_graphs.cfg.yaml").exists() and (tmp_path / "small_compile_model.cfg.yaml").exists()
