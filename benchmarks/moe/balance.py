"""Do the shipped MoE presets keep their balance at the default lr? Each preset runs twice from the same seed, with
and without balanced selection (MoEArgs.balanced_selection), as `forge-train` commands in one process each:

    .venv/bin/python benchmarks/moe/balance.py [--steps 300] [--out /tmp/moe-balance] [--only moe_tiny]

Prints, per run, the steps from step 20 on that break the issue's bound (some layer's busiest expert at 3x its even
share or more, or an expert without tokens), the worst shares over those steps, the final train and validation
losses and the throughput, and draws each preset's two runs with `forge-plot` (loss and expert loads) into --out.
`moe` is an alias of `moe_tiny` and is not run twice; deepseek_v3_small runs scaled down (4 layers of dim 256).

Last result (300 steps, CPU flags avx512_bf16, 2 vCPUs; the loads are multiples of the even share):

    run                          broken    max    min   train     val   tok/s
    moe_tiny balanced                 0   1.04   0.90  5.1406  5.0526   5,022
    moe_tiny sign/aux only           38   4.00   0.00  5.2290  5.1316   4,319
    deepseek_v3_small balanced        0   1.19   0.59  5.1077  5.0064   2,138
    deepseek_v3_small sign/aux only  279  10.67   0.00  5.1600  5.0466   2,035

(of 281 steps from step 20 on; tokens/s are a shared machine's, the two runs of a preset back to back.)
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import ROOT, cpu_flags  # noqa: E402
from forge.metrics.plot import expert_load_extremes, plot_runs  # noqa: E402

PRESETS = {
    "moe_tiny": ["model=moe_tiny"],
    "deepseek_v3_small": [
        "model=deepseek_v3_small", "model.n_layers=4", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=4",
        "model.ffn_dim=512", "model.vocab_size=${data.vocab_size}", "model.max_seq_len=1024",
    ],
}  # fmt: skip
BOUND = 3.0
FROM_STEP = 20


def train(run_dir: Path, overrides: list[str]) -> None:
    command = [sys.executable, "-m", "forge.train", *overrides, f"hydra.run.dir={run_dir}"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def summarise(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loads = [(r["step"], *extremes) for r in records if "loss" in r and (extremes := expert_load_extremes(r))]
    late = [(top, low) for step, top, low in loads if step >= FROM_STEP]
    train_records = [r for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "broken": sum(top >= BOUND or low == 0 for top, low in late),
        "max": max(top for top, _ in late),
        "min": min(low for _, low in late),
        "train": train_records[-1]["loss"],
        "val": vals[-1],
        "tokens_per_s": sum(r["tokens_per_s"] for r in train_records[1:]) / max(1, len(train_records) - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("/tmp/moe-balance"))
    parser.add_argument("--only", choices=sorted(PRESETS))
    opts = parser.parse_args()
    print(f"CPU flags: {cpu_flags()} | {opts.steps} steps, default lr and warmup, every step logged")
    print(f"{'run':<28} {'broken':>6} {'max':>6} {'min':>6} {'train':>7} {'val':>7} {'tok/s':>7}")
    for preset, overrides in PRESETS.items():
        if opts.only and preset != opts.only:
            continue
        runs = []
        for balanced in (True, False):
            name = f"{preset}_{'balanced' if balanced else 'unbalanced'}"
            run_dir = opts.out / name
            train(run_dir, [*overrides, f"train.steps={opts.steps}", "train.log_every=1", "train.eval_every=0",
                            f"model.moe.balanced_selection={str(balanced).lower()}"])  # fmt: skip
            s = summarise(run_dir)
            label = f"{preset} {'balanced' if balanced else 'sign/aux only'}"
            print(f"{label:<28} {s['broken']:>6} {s['max']:>6.2f} {s['min']:>6.2f} {s['train']:>7.4f} "
                  f"{s['val']:>7.4f} {s['tokens_per_s']:>7,.0f}")  # fmt: skip
            runs.append(run_dir)
        print(f"  plot: {plot_runs(runs, opts.out / f'{preset}.png')}")


if __name__ == "__main__":
    main()
