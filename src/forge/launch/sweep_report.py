"""forge-sweep-report MULTIRUN_DIR: one row per sweep point (its overrides, status, final train loss, last
validation loss, tokens/s, MFU), ranked by validation loss; writes sweep_report.csv and sweep_curves.png beside the
points.

    forge-sweep-report multirun/2026-12-06/10-00-00

A point is a numbered folder Hydra made (`0`, `1`, ...). Its status: `done` (its last logged step is the run's
train.steps), `refused: ...` or `failed: ...` (the line forge-train recorded when the point stopped; the sweep ran
the others), `stopped at step N` (it ended early otherwise: a kill, a preemption), `not started` (no metrics).
"""

import argparse
import csv
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from forge.launch.sweep_point import FAILED_FILE
from forge.metrics.plot import MetricsFileError, plot_runs, read_records

COLUMNS = ("point", "overrides", "status", "loss", "val_loss", "tokens_per_s", "mfu")


@dataclass
class Point:
    """What one sweep point's run directory says."""

    point: str
    overrides: str
    status: str
    loss: float | None
    val_loss: float | None
    tokens_per_s: float | None
    mfu: float | None


def sweep_points(sweep_dir: Path) -> list[Path]:
    """The point folders of a Hydra multirun directory, in job order."""
    points = [p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit() and (p / ".hydra").is_dir()]
    return sorted(points, key=lambda p: int(p.name))


def read_point(run: Path) -> Point:
    """A point's row from its .hydra files and metrics.jsonl."""
    overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) or []
    config = run / ".hydra" / "config.yaml"
    steps = (yaml.safe_load(config.read_text()) or {}).get("train", {}).get("steps") if config.is_file() else None
    records = read_records(run) if (run / "metrics.jsonl").is_file() else []
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    last_step = max((r.get("step", 0) for r in records), default=None)
    if (run / FAILED_FILE).is_file():
        status = (run / FAILED_FILE).read_text().strip()
    elif last_step is None:
        status = "not started"
    elif steps is not None and last_step >= steps:
        status = "done"
    else:
        status = f"stopped at step {last_step}"
    timed = train[1:] or train  # the first logged interval holds the start-up
    return Point(
        point=run.name,
        overrides=" ".join(map(str, overrides)),
        status=status,
        loss=train[-1]["loss"] if train else None,
        val_loss=evals[-1]["val_loss"] if evals else None,
        tokens_per_s=statistics.mean(r["tokens_per_s"] for r in timed) if timed else None,
        mfu=statistics.mean(mfus) if (mfus := [r["mfu"] for r in timed if r.get("mfu") is not None]) else None,
    )


def ranked(points: list[Point]) -> list[Point]:
    """By validation loss, lowest first; points without one last, in job order."""
    return sorted(points, key=lambda p: (p.val_loss is None, p.val_loss if p.val_loss is not None else 0))


def table(points: list[Point]) -> str:
    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    width = max([len("overrides"), *(len(p.overrides) for p in points)])
    state = max([18, *(len(p.status) for p in points)])
    lines = [f"{'#':>3}  {'overrides':<{width}}  {'status':<{state}} "
             f"{'loss':>8} {'val loss':>9} {'tok/s':>9} {'MFU':>6}"]  # fmt: skip
    for p in points:
        lines.append(f"{p.point:>3}  {p.overrides:<{width}}  {p.status:<{state}} {number(p.loss, '.4f'):>8} "
                     f"{number(p.val_loss, '.4f'):>9} {number(p.tokens_per_s, ',.0f'):>9} "
                     f"{number(p.mfu, '.1%'):>6}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge-sweep-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a Hydra multirun directory (hydra.sweep.dir)")
    args = parser.parse_args(argv)
    sweep_dir = args.sweep_dir
    runs = sweep_points(sweep_dir) if sweep_dir.is_dir() else []
    if not runs:
        print(f"forge-sweep-report: {sweep_dir} holds no sweep points (numbered folders with .hydra/)", file=sys.stderr)
        return 2
    try:
        points = ranked([read_point(run) for run in runs])
    except (MetricsFileError, yaml.YAMLError, OSError) as err:
        print(f"forge-sweep-report: {err}", file=sys.stderr)
        return 1
    print(table(points))
    with open(sweep_dir / "sweep_report.csv", "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(asdict(p) for p in points)
    started = [run for run in runs if (run / "metrics.jsonl").is_file()]
    if started:
        plot_runs(started, sweep_dir / "sweep_curves.png")
    print(f"wrote {sweep_dir / 'sweep_report.csv'} and {sweep_dir / 'sweep_curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
