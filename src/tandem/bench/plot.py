"""`tandem bench plot`: latency against throughput, one line per result set.

The picture has two panels, TTFT and TPOT, each with the median (solid) and p99 (dashed) of every
set against the chosen throughput, points joined in load order and tagged with their load
(`c8`: max concurrency 8, `r2`: 2 requests/s). The title names the sets (or is --title), and a
second line says what ran, from the points: model, workload, date. Invariants: the PNG is always
FIGURE_SIZE_IN x DPI
pixels (no tight bounding box); points without a value (no successful request) are left out;
matplotlib is used through `Figure` and the Agg canvas only, never pyplot's global state.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
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


def distinct(result_sets: Sequence[ResultSet], describe: Callable[[dict[str, Any]], str]) -> str:
    """`describe` of every point, each different text once, in order, joined by " / "."""
    texts = [describe(point) for result_set in result_sets for point in result_set.points]
    return " / ".join(dict.fromkeys(text for text in texts if text))


def workload(point: dict[str, Any]) -> str:
    """The dataset of a point, in a few words: `random 1024 in / 128 out tokens`."""
    name = point.get("dataset_name")
    if name == "random":
        text = f"random {point.get('random_input_len')} in / {point.get('random_output_len')} out"
        text += " tokens"
        if point.get("random_range_ratio"):
            text += f" (±{point['random_range_ratio']:g})"
        if point.get("random_prefix_len"):
            text += f", {point['random_prefix_len']} shared"
    elif name == "prefix":
        text = (
            f"prefix repetition {point.get('prefix_repetition_prefix_len')} + "
            f"{point.get('prefix_repetition_suffix_len')} in / "
            f"{point.get('prefix_repetition_output_len')} out tokens"
        )
    elif name == "sharegpt":
        output_len = point.get("sharegpt_output_len")
        text = "sharegpt" + (f", {output_len} out tokens" if output_len else "")
    else:
        return ""
    if point.get("endpoint") == "/v1/chat/completions":
        text += ", chat"
    if point.get("num_prompts"):
        text += f", {point['num_prompts']} prompts"
    return text


def run_date(point: dict[str, Any]) -> str:
    """`20261125-233000` (a result's date) -> `2026-11-25`."""
    date = str(point.get("date") or "")
    return f"{date[:4]}-{date[4:6]}-{date[6:8]}" if len(date) >= 8 else ""


def plot_title(result_sets: Sequence[ResultSet], title: str | None = None) -> str:
    """The title (`title`, else the sets' labels) over a line naming model, workload and date."""
    heading = title or " vs ".join(result_set.label for result_set in result_sets)
    details = [
        distinct(result_sets, lambda point: str(point.get("model_id") or "")),
        distinct(result_sets, workload),
        distinct(result_sets, run_date),
    ]
    subtitle = " · ".join(detail for detail in details if detail)
    return f"{heading}\n{subtitle}" if subtitle else heading


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
    full_title = plot_title(result_sets, title)
    figure.suptitle(full_title)
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", metadata={"Title": full_title})
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
