"""One rank of a short forge-train run under torch.profiler's memory recording: writes the rank's peak of live
tensor bytes (what torch's CPU allocator reports to the profiler: parameters, gradients, optimizer state,
activations, communication buffers; the CPU counterpart of torch.cuda.max_memory_allocated) to OUT/rank{R}.json.

    python -m torch.distributed.run --standalone --nproc_per_node=4 benchmarks/search/rank_memory.py OUT OVERRIDES...

Recording every allocation slows the steps: predict_vs_measured.py times the same layout in a run of its own.
"""

import json
import os
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from forge.config import compose  # noqa: E402
from forge.config.resolve import fit_warmup_to_run, override_keys  # noqa: E402
from forge.metrics.memory import peak_live_tensor_bytes  # noqa: E402
from forge.train.trainer import Trainer  # noqa: E402


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    cfg = compose(overrides)
    fit_warmup_to_run(cfg, override_keys(overrides))  # as forge-train does: a preset's warmup cut to a short run
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        Trainer(cfg, out / "run").fit()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_bytes": peak_live_tensor_bytes(prof)}))


if __name__ == "__main__":
    main()
