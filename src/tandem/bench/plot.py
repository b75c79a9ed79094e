"""`tandem bench plot`: latency against throughput, one line per result set.

The picture has two panels, TTFT and TPOT, each with the median (solid) and p99 (dashed) of every
set against the chosen throughput, points joined in load order and tagged with their load
(`c8`: max concurrency 8, `r2`: 2 requests/s). Invariants: the PNG is always FIGURE_SIZE_IN x DPI
pixels (no tight bounding box); points without a value (no successful request) are left out;
matplotlib is used through `Figure` and the Agg canvas only, never pyplot's global state.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.bench.errors import BenchError
from tandem.bench.results import ResultSet, load_result_sets

FIGURE_SIZE_IN = (12.0, 5.0)
DPI = 100
PANELS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))
STATISTICS = (("median", "p50", "-", "o"), ("p99", "p99", "--", "x"))
X_LABELS = {
    "output_throughput": "output throughput (tok/s)",
    "request_throughput": "request throughput (req/s)",
    "total_token_throughput": "total token throughput (tok/s)",
}


def load_tag(point: dict[str, Any]) -> str:
    if point.get("max_concurrency") is not None:
        return f"c{point['max_concurrency']}"
    return f"r{point.get('request_rate')}"


def plot_result_sets(
    result_sets: Sequence[ResultSet],
    output: str | Path,
    title: str | None = None,
    x_metric: str = "output_throughput",
) -> Path:
    """Draw `result_sets` into the PNG `output` and return its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(PANELS))
    for axis, (metric, y_label) in zip(axes, PANELS, strict=True):
        for set_index, result_set in enumerate(result_sets):
            color = f"C{set_index % 10}"
            for statistic, tag, line_style, marker in STATISTICS:
                points = [
                    (point[x_metric], point[f"{statistic}_{metric}_ms"], load_tag(point))
                    for point in result_set.points
                    if point.get(f"{statistic}_{metric}_ms") is not None
                ]
                if not points:
                    continue
                xs, ys, _ = zip(*points, strict=True)
                axis.plot(
                    xs,
                    ys,
                    linestyle=line_style,
                    marker=marker,
                    color=color,
                    label=f"{result_set.label} {tag}",
                )
                if statistic == "median":
                    for x, y, load in points:
                        axis.annotate(
                            load, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                        )
        axis.set_xlabel(X_LABELS[x_metric])
        axis.set_ylabel(y_label)
        axis.grid(True, alpha=0.3)
        if axis.lines:
            axis.legend(fontsize="small")
    figure.suptitle(title or " vs ".join(result_set.label for result_set in result_sets))
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def main(args: argparse.Namespace) -> int:
    """`tandem bench plot`."""
    try:
        result_sets = load_result_sets(args.results)
    except (OSError, ValueError) as exc:
        raise BenchError(f"could not read the results: {exc}") from exc
    path = plot_result_sets(result_sets, args.output, args.title, args.x_metric)
    print(f"wrote {path}")
    return 0
