"""`tandem bench plot`: latency against throughput, one line per result set.

The picture has two panels, TTFT and TPOT, each with the median (solid) and p99 (dashed) of every
set against the chosen throughput, points joined in load order and tagged with their load
(`c8`: max concurrency 8, `r2`: 2 requests/s); with `goodput_panel` a first panel shows goodput
(requests/s within every SLO) against the swept load, one line per set. The title names the sets
(or is --title), and a second line says what ran, from the points: model, workload, date.
Invariants: the PNG is always PANEL_WIDTH_IN x FIGURE_HEIGHT_IN inches per panel at DPI (no
tight bounding box); points without a value (no successful request, no SLO) are left out;
matplotlib is used through `Figure` and the Agg canvas only, never pyplot's global state.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.bench.errors import BenchError
from tandem.bench.results import ResultSet, load_order, load_result_sets

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PANEL_WIDTH_IN = 6.0
FIGURE_HEIGHT_IN = 5.0
DPI = 100
PANELS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))
STATISTICS = (("median", "p50", "-", "o"), ("p99", "p99", "--", "x"))
X_LABELS = {
    "output_throughput": "output throughput (tok/s)",
    "request_throughput": "request throughput (req/s)",
    "total_token_throughput": "total token throughput (tok/s)",
}
GOODPUT_X_LABELS = {"request_rate": "request rate (req/s)", "max_concurrency": "max concurrency"}


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


def draw_latency_panels(
    axes: Sequence[Any], result_sets: Sequence[ResultSet], x_metric: str
) -> None:
    """TTFT and TPOT (median solid, p99 dashed) against `x_metric`, one axis each."""
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


def swept_parameter(result_sets: Sequence[ResultSet]) -> str:
    """`max_concurrency` when some set's points differ in it, else `request_rate`."""
    for result_set in result_sets:
        if len({point.get("max_concurrency") for point in result_set.points}) > 1:
            return "max_concurrency"
    return "request_rate"


def load_positions(values: Sequence[Any]) -> tuple[dict[str, float], list[str] | None]:
    """x positions of the load values: the numbers themselves when all are finite numbers, else
    evenly spaced in load order (an unlimited rate is "inf") with the values as tick labels."""
    ordered = sorted(dict.fromkeys(values), key=lambda value: load_order({"request_rate": value}))
    if all(isinstance(value, int | float) for value in ordered):
        return {str(value): float(value) for value in ordered}, None
    return {str(value): float(index) for index, value in enumerate(ordered)}, list(
        map(str, ordered)
    )


def slo_text(result_sets: Sequence[ResultSet]) -> str:
    """`SLO: TTFT <= 1000 ms, TPOT <= 25 ms` from the points' `goodput_slos_ms`."""
    texts = []
    for result_set in result_sets:
        for point in result_set.points:
            slos = point.get("goodput_slos_ms") or {}
            texts.append(", ".join(f"{name.upper()} ≤ {ms:g} ms" for name, ms in slos.items()))
    distinct_texts = " / ".join(dict.fromkeys(text for text in texts if text))
    return f"SLO: {distinct_texts}" if distinct_texts else ""


def draw_goodput_panel(axis: Any, result_sets: Sequence[ResultSet]) -> None:
    """Goodput (requests/s within every SLO) against the swept load, one line per set."""
    parameter = swept_parameter(result_sets)
    loads = [point.get(parameter) for result_set in result_sets for point in result_set.points]
    positions, tick_labels = load_positions([load for load in loads if load is not None])
    for set_index, result_set in enumerate(result_sets):
        points = sorted(
            (positions[str(point[parameter])], point["request_goodput"])
            for point in result_set.points
            if point.get(parameter) is not None and point.get("request_goodput") is not None
        )
        if points:
            xs, ys = zip(*points, strict=True)
            axis.plot(xs, ys, marker="o", color=f"C{set_index % 10}", label=result_set.label)
    if tick_labels is not None:
        axis.set_xticks(list(positions.values()), tick_labels)
    axis.set_xlabel(GOODPUT_X_LABELS[parameter])
    axis.set_ylabel("goodput (req/s within SLO)")
    axis.set_title(slo_text(result_sets) or "no SLO given (--goodput ttft:MS tpot:MS)", fontsize=9)
    axis.set_ylim(bottom=0)
    axis.grid(True, alpha=0.3)
    if axis.lines:
        axis.legend(fontsize="small")


def result_figure(
    result_sets: Sequence[ResultSet],
    title: str | None = None,
    x_metric: str = "output_throughput",
    goodput_panel: bool = False,
) -> Figure:
    """The picture of `result_sets`: [goodput against load,] TTFT and TPOT against throughput."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    num_panels = len(PANELS) + goodput_panel
    figure = Figure(figsize=(PANEL_WIDTH_IN * num_panels, FIGURE_HEIGHT_IN), dpi=DPI)
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(1, num_panels))
    if goodput_panel:
        draw_goodput_panel(axes.pop(0), result_sets)
    draw_latency_panels(axes, result_sets, x_metric)
    figure.suptitle(plot_title(result_sets, title))
    return figure


def plot_result_sets(
    result_sets: Sequence[ResultSet],
    output: str | Path,
    title: str | None = None,
    x_metric: str = "output_throughput",
    goodput_panel: bool = False,
) -> Path:
    """Draw `result_sets` into the PNG `output` and return its path."""
    figure = result_figure(result_sets, title, x_metric, goodput_panel)
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", metadata={"Title": plot_title(result_sets, title)})
    return path


def main(args: argparse.Namespace) -> int:
    """`tandem bench plot`."""
    try:
        result_sets = load_result_sets(args.results)
    except (OSError, ValueError) as exc:
        raise BenchError(f"could not read the results: {exc}") from exc
    path = plot_result_sets(result_sets, args.output, args.title, args.x_metric, args.goodput_panel)
    print(f"wrote {path}")
    return 0
