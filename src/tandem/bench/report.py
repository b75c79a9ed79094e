"""Terminal output of `tandem bench`: the live progress bar and the summary tables (rich).

Invariant: reporting never changes what is measured; the progress bar is only told about requests
that have finished, after their timestamps are taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

LATENCY_ROWS = (
    ("ttft", "Time to first token"),
    ("ttst", "Time to second token"),
    ("tpot", "Time per output token (excl. 1st)"),
    ("itl", "Inter-token latency"),
    ("e2el", "End-to-end latency"),
)


def make_console() -> Console:
    """A console for the benchmark's output; wide when it goes to a file or pipe, so tables keep
    their numbers whole."""
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)
    return console


class ProgressBar:
    """A live bar of finished requests for one load point, with the number that failed."""

    def __init__(self, console: Console, enabled: bool) -> None:
        self._progress = (
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed: {task.fields[failed]}"),
                TimeElapsedColumn(),
                console=console,
            )
            if enabled
            else None
        )
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def start_point(self, description: str, total: int) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(description, total=total, failed=0)

    def request_done(self, num_failed: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=1, failed=num_failed)


def format_value(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100.0 * fraction


def point_title(result: dict[str, Any]) -> str:
    concurrency = result.get("max_concurrency")
    return (
        f"{result.get('label')}: request rate {result['request_rate']}, "
        f"max concurrency {concurrency if concurrency is not None else 'unlimited'}"
    )


def print_point_summary(
    console: Console, result: dict[str, Any], percentiles: Sequence[float]
) -> None:
    """vLLM's "Serving Benchmark Result" block, as a table."""
    from tandem.bench.metrics import percentile_key

    console.print(f"[bold]{point_title(result)}[/bold]")
    table = Table(show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", result["duration"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Request goodput (req/s)", result["request_goodput"]),
        ("Requests within SLO (%)", percent(result.get("slo_attainment"))),
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
        ("Peak output token throughput (tok/s)", result["max_output_tokens_per_s"]),
        ("Peak concurrent requests", result["max_concurrent_requests"]),
    ]
    for name, value in rows:
        table.add_row(name, format_value(value))
    for metric, header in LATENCY_ROWS:
        table.add_section()
        table.add_row(f"[bold]{header}[/bold]", "")
        upper = metric.upper()
        table.add_row(f"Mean {upper} (ms)", format_value(result[f"mean_{metric}_ms"]))
        table.add_row(f"Median {upper} (ms)", format_value(result[f"median_{metric}_ms"]))
        for percentile in percentiles:
            key = percentile_key(metric, percentile)
            table.add_row(f"{key.split('_')[0].upper()} {upper} (ms)", format_value(result[key]))
    console.print(table)
    errors = sorted({error for error in result.get("errors", []) if error})
    for error in errors[:5]:
        console.print(f"[red]failed request:[/red] {error}")


def print_sweep_summary(console: Console, results: Sequence[dict[str, Any]]) -> None:
    """One row per load point: throughput against TTFT / TPOT medians and p99s."""
    console.print(f"[bold]{results[0].get('label')}: sweep[/bold]")
    table = Table()
    columns = (
        ("rate", "request_rate"),
        ("concurrency", "max_concurrency"),
        ("ok", "completed"),
        ("failed", "failed"),
        ("req/s", "request_throughput"),
        ("out tok/s", "output_throughput"),
        ("TTFT p50", "median_ttft_ms"),
        ("TTFT p99", "p99_ttft_ms"),
        ("TPOT p50", "median_tpot_ms"),
        ("TPOT p99", "p99_tpot_ms"),
        ("ITL p50", "median_itl_ms"),
    )
    for header, _ in columns:
        table.add_column(header, justify="right")
    for result in results:
        table.add_row(*(format_value(result.get(key)) for _, key in columns))
    console.print(table)


def print_comparison_summary(console: Console, rows: Sequence[dict[str, Any]]) -> None:
    """One row per configuration and load point: throughput, goodput, latency tails."""
    console.print("[bold]comparison[/bold]")
    table = Table()
    columns = (
        ("configuration", "configuration"),
        ("rate", "request_rate"),
        ("concurrency", "max_concurrency"),
        ("failed", "failed"),
        ("req/s", "request_throughput"),
        ("goodput req/s", "request_goodput"),
        ("within SLO %", "slo_attainment"),
        ("TTFT p99 ms", "p99_ttft_ms"),
        ("TPOT p99 ms", "p99_tpot_ms"),
        ("role changes", "role_changes"),
    )
    for header, _ in columns:
        table.add_column(header, justify="left" if header == "configuration" else "right")
    previous = None
    for row in rows:
        if previous is not None and row["configuration"] != previous:
            table.add_section()
        previous = row["configuration"]
        changes = (row.get("router_decisions") or {}).get("role_changes") or {}
        values = {
            **row,
            "slo_attainment": percent(row.get("slo_attainment")),
            "role_changes": " ".join(f"{duty} {count:g}" for duty, count in changes.items()),
        }
        table.add_row(*(format_value(values.get(key)) for _, key in columns))
    console.print(table)
