"""Learning curves of seed sweeps as a PNG: one line per seed, the median and the min-max band.

    python scripts/analysis/plot_curves.py --run LABEL=DIR [--run LABEL=DIR ...] \
        --out FILE.png [--metric eval/success] [--x minutes|step] [--target 0.8] \
        [--title TEXT]

Each DIR is a `seed_sweep.py --out` folder (one `seed<S>/metrics.jsonl` per seed; any
subfolder holding a `metrics.jsonl` counts as one seed, others are ignored) or a single
run's `output_dir` (a `metrics.jsonl` directly in DIR). From each run's `metrics.jsonl` it
takes every record that has `--metric` (default `eval/success`, logged on eval steps only),
at its `step` (`--x step`) or its `time/elapsed` in minutes (`--x minutes`, the default: wall
time since the run started, model build and warm-up included). A resumed run's
`time/elapsed` starts again from 0; its curve continues from the last time logged before the
restart. Records whose value is not finite ("nan", "inf") are left out.

Per LABEL the figure has one thin line per seed and, over a common x grid (every x at which
some seed of the label has a point), the median across seeds (thick line) and the band from
the minimum to the maximum. Each seed's curve is interpolated linearly onto the grid. The
grid starts at the latest first point of the label's seeds (where every seed has a value)
and ends at the last point of the longest run: a seed that stopped earlier (a sweep's
`--stop-at-target`, a budget, a crash) is held at its last value to that end, drawn dotted.
`--target` draws a dashed horizontal line.

Prints one JSON line: per label the runs and their point counts, the grid's range, the
median at its end (`final_median`), and `reached_x`, the first grid x where the median is at
or above `--target` (null if never, or without `--target`). A missing DIR, a DIR without
any metrics.jsonl, or a metric that no run of a DIR logs is a one-line `error:` and exit
status 2. The PNG carries no timestamp or software tag, so a rerun on the same data and
matplotlib gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import numpy as np

FIGSIZE_IN = (8.0, 4.5)
DPI = 150  # 1200 x 675 pixels
X_LABELS = {"minutes": "wall time since the run started (minutes)",
            "step": "pipeline step (rollout + updates)"}
CAPTION = ("Thick line: median across seeds; band: min to max; thin lines: single seeds. "
           "A seed that stopped early is held at its last value (dotted) to the end of the "
           "longest run; the band starts where every seed has a point.")


class PlotError(Exception):
    """A problem with the input, reported as one `error:` line and exit status 2."""


def parse_run_spec(text: str) -> tuple[str, str]:
    """"LABEL=DIR" -> (LABEL, DIR); the label is everything before the first "="."""
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise PlotError(f"--run {text!r} is not LABEL=DIR")
    return label, path


def _natural_key(name: str):
    """seed2 before seed10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def find_runs(directory: str) -> dict[str, str]:
    """{run name: metrics.jsonl path} of a sweep folder (one per subfolder that has one,
    in natural order) or of a single run's output_dir."""
    if not os.path.exists(directory):
        raise PlotError(f"{directory}: no such directory")
    if not os.path.isdir(directory):
        raise PlotError(f"{directory} is not a directory")
    own = os.path.join(directory, "metrics.jsonl")
    if os.path.isfile(own):
        return {os.path.basename(os.path.normpath(directory)): own}
    runs = {}
    for name in sorted(os.listdir(directory), key=_natural_key):
        path = os.path.join(directory, name, "metrics.jsonl")
        if os.path.isfile(path):
            runs[name] = path
    if not runs:
        raise PlotError(f"{directory} holds no metrics.jsonl (neither in it nor in a subfolder)")
    return runs


def read_curve(path: str, metric: str, x: str) -> list[tuple[float, float]]:
    """[(x, value)] of a metrics.jsonl's records that have `metric`, in step order.

    x is the step, or `time/elapsed` in minutes made continuous across resumes (when it
    drops, the time logged before the drop is added from there on). A step logged twice
    keeps its last record; unparsable lines (a run killed mid-write) are skipped."""
    records: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records[int(record["step"])] = record
            except (ValueError, KeyError, TypeError):
                continue
    points = []
    offset, last_elapsed = 0.0, None
    for step in sorted(records):
        record = records[step]
        elapsed = record.get("time/elapsed")
        if elapsed is not None:
            elapsed = float(elapsed)
            if last_elapsed is not None and elapsed < last_elapsed:
                offset += last_elapsed
            last_elapsed = elapsed
        if metric not in record:
            continue
        try:
            value = float(record[metric])
        except (TypeError, ValueError):
            continue
        if not math.isfinite(value):
            continue
        if x == "step":
            points.append((float(step), value))
        elif elapsed is not None:
            points.append(((offset + elapsed) / 60.0, value))
    return points


def band(curves: list[list[tuple[float, float]]]):
    """(grid, per-seed values on it [seeds, grid]) over the grid described in the module
    docstring; each seed interpolated linearly and held at its last value past its end."""
    start = max(c[0][0] for c in curves)
    grid = np.array(sorted({px for c in curves for px, _ in c if px >= start}))
    values = np.stack([np.interp(grid, [p[0] for p in c], [p[1] for p in c]) for c in curves])
    return grid, values


def _round(value: float) -> float:
    return round(float(value), 6)


def summarize(directory: str, curves: dict[str, list], grid, values,
              target: float | None) -> dict:
    median = np.median(values, axis=0)
    reached = None
    if target is not None:
        hits = np.nonzero(median >= target)[0]
        reached = _round(grid[hits[0]]) if hits.size else None
    return {"dir": directory, "seeds": len(curves),
            "runs": {name: len(points) for name, points in curves.items()},
            "points": sum(len(points) for points in curves.values()),
            "x_start": _round(grid[0]), "x_end": _round(grid[-1]),
            "final_median": _round(median[-1]),
            "final_min": _round(values[:, -1].min()), "final_max": _round(values[:, -1].max()),
            "reached_x": reached}


def load_label(directory: str, metric: str, x: str) -> dict[str, list]:
    """{run name: curve} of the runs of `directory` that log `metric` (others are named on
    stderr); PlotError if none does."""
    curves = {name: read_curve(path, metric, x) for name, path in find_runs(directory).items()}
    empty = [name for name, points in curves.items() if not points]
    if len(empty) == len(curves):
        needs = f"{metric!r}" + (" with 'time/elapsed'" if x == "minutes" else "")
        raise PlotError(f"no run in {directory} logs {needs} (finite values)")
    if empty:
        print(f"{directory}: {', '.join(empty)} log no {metric!r}; left out", file=sys.stderr)
    return {name: points for name, points in curves.items() if points}


def draw(out: str, labels: dict[str, dict], metric: str, x: str, target: float | None,
         title: str) -> None:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.lines import Line2D

    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)  # the Agg backend for this figure only; pyplot's state is untouched
    ax = fig.add_subplot()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    handles, names = [], []
    all_values = []
    for i, (label, data) in enumerate(labels.items()):
        color = colors[i % len(colors)]
        grid, values, curves = data["grid"], data["values"], data["curves"]
        for points in curves.values():
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, color=color, linewidth=0.8, alpha=0.45)
            if xs[-1] < grid[-1]:
                ax.plot([xs[-1], grid[-1]], [ys[-1], ys[-1]], color=color, linewidth=0.8,
                        alpha=0.45, linestyle=":")
            all_values.extend(ys)
        patch = ax.fill_between(grid, values.min(axis=0), values.max(axis=0), color=color,
                                alpha=0.18, linewidth=0)
        (line,) = ax.plot(grid, np.median(values, axis=0), color=color, linewidth=2.5)
        handles.append((patch, line))
        seeds = len(curves)
        names.append(f"{label} ({seeds} seed{'s' if seeds != 1 else ''})")
    handles.append(Line2D([], [], color="0.4", linewidth=0.8))
    names.append("single seed (dotted: held at its last value)")
    if target is not None:
        ax.axhline(target, color="0.3", linestyle="--", linewidth=1.0)
        handles.append(Line2D([], [], color="0.3", linestyle="--", linewidth=1.0))
        names.append(f"target {target:g}")
    if all_values and min(all_values) >= 0.0 and max(all_values) <= 1.0 and (
            target is None or 0.0 <= target <= 1.0):
        ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel(metric + (" (fraction of episodes)" if metric.endswith("success") else ""))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(handles, names, handler_map={tuple: HandlerTuple(ndivide=1)}, loc="best",
              fontsize="small")
    fig.text(0.01, 0.01, CAPTION, fontsize=6.5, color="0.3", wrap=True, va="bottom")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, format="png", dpi=DPI, metadata={"Software": None})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=DIR",
                        help="a curve's legend label and its sweep folder (repeatable)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--metric", default="eval/success")
    parser.add_argument("--x", choices=("minutes", "step"), default="minutes")
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    title = args.title or f"{args.metric} by {'wall time' if args.x == 'minutes' else 'step'}"
    try:
        labels: dict[str, dict] = {}
        for spec in args.run:
            label, directory = parse_run_spec(spec)
            if label in labels:
                raise PlotError(f"label {label!r} is given twice")
            curves = load_label(directory, args.metric, args.x)
            grid, values = band(list(curves.values()))
            labels[label] = {"dir": directory, "curves": curves, "grid": grid,
                             "values": values}
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    draw(args.out, labels, args.metric, args.x, args.target, title)
    print(json.dumps({
        "out": args.out, "metric": args.metric, "x": args.x, "target": args.target,
        "labels": {label: summarize(d["dir"], d["curves"], d["grid"], d["values"],
                                    args.target) for label, d in labels.items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
