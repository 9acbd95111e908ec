"""forge-plot RUN_DIR...: loss, learning rate and tokens/s of one run or a sweep, from metrics.jsonl, as a PNG;
for an MoE, the expert loads too.

A directory without its own metrics.jsonl is searched for runs below it (a Hydra multirun folder is a sweep).
"""

import argparse
import json
import logging
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))
MOE_TITLE = "expert load / even share"

log = logging.getLogger("forge")


class MetricsFileError(ValueError):
    """A metrics.jsonl that cannot be plotted; the message names the file and line."""


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories (holding metrics.jsonl) at or below each path, in order."""
    runs: list[Path] = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
        else:
            runs.extend(sorted(p.parent for p in path.rglob("metrics.jsonl")))
    return runs


def read_records(run: Path) -> list[dict]:
    """The records of run/metrics.jsonl. A last line cut short (the run was killed while writing it) is skipped
    with a warning; a bad line before it is a MetricsFileError."""
    path = run / "metrics.jsonl"
    lines = [(n, line) for n, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line.strip()]
    records = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == lines[-1][0]:
                log.warning("forge-plot: warning: %s:%d: last line cut short (%s), skipped", path, number, err.msg)
                continue
            raise MetricsFileError(f"{path}:{number}: not a JSON line ({err.msg})") from None
        if not isinstance(record, dict):
            raise MetricsFileError(f"{path}:{number}: not a metrics record (a JSON object)")
        records.append(record)
    return records


def saved_overrides(run: Path) -> list[str]:
    """The command-line overrides Hydra saved for the run, or [] without them."""
    path = run / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    return [line.removeprefix("- ").strip() for line in path.read_text().splitlines() if line.strip()]


def run_label(run: Path, runs: list[Path]) -> str:
    """The overrides that set this run apart from the others (a sweep's distinguishing keys), else its folder
    name."""
    own = saved_overrides(run)
    shared = set.intersection(*(set(saved_overrides(other)) for other in runs)) if len(runs) > 1 else set(own)
    return " ".join(item for item in own if item not in shared) or run.name


def expert_load_extremes(record: dict) -> tuple[float, float] | None:
    """(largest load_max, smallest load_min) over an MoE's layers in one record, as multiples of the even share;
    None for a record without them."""
    tops = [v for k, v in record.items() if k.startswith("moe/") and k.endswith("/load_max")]
    lows = [v for k, v in record.items() if k.startswith("moe/") and k.endswith("/load_min")]
    return (max(tops), min(lows)) if tops and lows else None


def plot_runs(runs: list[Path], out: Path, width: float = 12.0, height: float = 3.6, dpi: int = 100) -> Path:
    """Draws one panel per curve (loss with val_loss, lr, tokens/s, and for an MoE the most and least loaded
    expert over its layers), one line per run; returns `out`."""
    runs_records = [read_records(run) for run in runs]
    moe = any(expert_load_extremes(r) for records in runs_records for r in records)
    panels = PANELS + (("", MOE_TITLE),) * moe
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels) / len(PANELS), height), dpi=dpi)
    for run, records in zip(runs, runs_records):
        label = run_label(run, runs)
        train = [r for r in records if "loss" in r and "step" in r]
        evals = [r for r in records if "val_loss" in r and "step" in r]
        for ax, (key, _) in zip(axes, PANELS):
            points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
            if points:
                (line,) = ax.plot(*zip(*points), label=label)
                if key == "loss" and evals:
                    steps, values = zip(*[(r["step"], r["val_loss"]) for r in evals])
                    ax.plot(steps, values, "o--", color=line.get_color(), label=f"{label} (val)")
        loads = [(r["step"], *extremes) for r in train if (extremes := expert_load_extremes(r))]
        if loads:
            steps, tops, lows = zip(*loads)
            (line,) = axes[-1].plot(steps, tops, label=f"{label} (max)")
            axes[-1].plot(steps, lows, "--", color=line.get_color(), label=f"{label} (min)")
    if moe:
        axes[-1].legend(fontsize="small")
    for ax, (_, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge-plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or folders of runs (a sweep)")
    parser.add_argument("-o", "--out", type=Path, help="PNG path (default: RUN_DIR/metrics.png, or ./forge-plot.png)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution (each panel is 4 x 3.6 inches)")
    args = parser.parse_args(argv)
    runs = find_runs(args.runs)
    if not runs:
        parser.error(f"no metrics.jsonl at or below {', '.join(map(str, args.runs))}")
    out = args.out or (runs[0] / "metrics.png" if len(runs) == 1 else Path("forge-plot.png"))
    try:
        plot_runs(runs, out, dpi=args.dpi)
    except MetricsFileError as err:
        print(f"forge-plot: {err}", file=sys.stderr)
        return 1
    print(f"{len(runs)} run(s) -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
