"""The layout search's prediction for a one-GPU run of forge-train, beside the run's measured step time.

    python -m benchmarks.search.predict_one_gpu OUT/dense_bf16_compile/metrics.jsonl OVERRIDES...

OVERRIDES are the run's (benchmarks/gpu.sh passes its row 1: llama3_1b, bf16, seq and micro-batch). The
prediction is what `forge-train --plan --search search.device=h200` ranks that layout by: the H200 row of the
device table and the default efficiencies. Without a metrics.jsonl (gpu.sh's DRY_RUN on a CPU) only the
prediction is printed. Measured: the mean step_time of the records after the first (warm-up and compilation).
"""

import json
import statistics
import sys
from pathlib import Path

from forge.config import compose
from forge.planning.search.cost import Layout, ModelShape, predict
from forge.planning.search.devices import DEVICES, GIB
from forge.planning.search.settings import SearchSettings
from forge.train import build


def prediction_line(overrides: list[str], metrics: Path, device: str = "h200") -> str:
    cfg = compose(overrides)
    micro = cfg.train.micro_batch_size or cfg.train.global_batch_size
    layout = Layout(1, 1, 1, 1, 1, str(cfg.parallel.activation_checkpoint), micro)
    dtype = "fp32" if cfg.train.dtype == "fp32" else "bf16"
    got = predict(layout, ModelShape.of(build.build_meta_model(cfg)), cfg.train, DEVICES[device], SearchSettings(),
                  dtype)  # fmt: skip
    line = f"search prediction ({device}, one GPU): {got.step:.3f} s/step, {got.memory / GIB:.1f} GiB peak"
    records = [json.loads(r) for r in metrics.read_text().splitlines()] if metrics.is_file() else []
    timed = [r["step_time"] for r in records if "step_time" in r][1:]
    if timed:
        measured = statistics.mean(timed)
        line += f"; measured {measured:.3f} s/step: predicted / measured {got.step / measured:.2f}"
    return line


if __name__ == "__main__":
    print(prediction_line(sys.argv[2:], Path(sys.argv[1])))
