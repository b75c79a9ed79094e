"""Result files of `tandem bench serve`: one JSON per load point, one combined file per sweep.

Layout of a point file: the run's settings, then the summary fields of `metrics.compute_metrics`
(vLLM's names), then vLLM's per-request arrays (`input_lens`, `output_lens`, `ttfts`, `itls`,
`generated_texts`, `errors`; seconds, token counts from the server's `usage`) and `requests`, one
record per request sent (milliseconds). A sweep file is `{"label", "sweep_parameter",
"sweep_values", "points": [point, ...], ...}`.

Invariant: `len(requests) == completed + failed == num_prompts` in every point.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.client import RequestRecord
from tandem.bench.datasets import SampleRequest
from tandem.bench.metrics import MS_PER_S


def rate_value(request_rate: float) -> float | str:
    """JSON has no infinity: an unlimited rate is written as "inf", as vLLM does."""
    return "inf" if math.isinf(request_rate) else request_rate


def optional_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * MS_PER_S


def request_entries(
    records: Sequence[RequestRecord], samples: Sequence[SampleRequest], origin: float
) -> list[dict[str, Any]]:
    """One JSON record per request; `start_s` is relative to the start of the point."""
    return [
        {
            "index": record.index,
            "success": record.success,
            "error": record.error or None,
            "http_status": record.http_status,
            "prompt_len": sample.prompt_len,
            "expected_output_len": sample.expected_output_len,
            "prompt_tokens": record.prompt_tokens,
            "output_tokens": record.output_tokens,
            "finish_reason": record.finish_reason,
            "start_s": record.start_time - origin,
            "ttft_ms": optional_ms(record.ttft),
            "ttst_ms": optional_ms(record.ttst),
            "tpot_ms": optional_ms(record.tpot),
            "e2el_ms": record.e2el * MS_PER_S,
            "itl_ms": [gap * MS_PER_S for gap in record.itl],
        }
        for record, sample in zip(records, samples, strict=True)
    ]


def per_request_arrays(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """vLLM's detailed arrays (0 tokens and None times for failed requests)."""
    return {
        "input_lens": [record.prompt_tokens if record.success else 0 for record in records],
        "output_lens": [record.output_tokens if record.success else 0 for record in records],
        "ttfts": [record.ttft if record.success else None for record in records],
        "itls": [record.itl if record.success else [] for record in records],
        "generated_texts": [record.generated_text for record in records],
        "errors": [record.error for record in records],
    }


@dataclass(frozen=True)
class ResultSet:
    """The points of one line in a plot, in load order."""

    label: str
    points: list[dict[str, Any]]


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def load_order(point: dict[str, Any]) -> tuple[float, float]:
    rate = point.get("request_rate", "inf")
    concurrency = point.get("max_concurrency")
    return (
        math.inf if rate == "inf" else float(rate),
        math.inf if concurrency is None else float(concurrency),
    )


def load_result_sets(paths: Sequence[str | Path]) -> list[ResultSet]:
    """Read result sets: a sweep file is one set; a point file is a set of one point; a folder is
    its point files (sweep files in it are skipped), one set per label."""
    sets: list[ResultSet] = []
    for path in map(Path, paths):
        if path.is_dir():
            by_label: dict[str, list[dict[str, Any]]] = {}
            for child in sorted(path.glob("*.json")):
                payload = json.loads(child.read_text())
                if "points" not in payload and "completed" in payload:
                    by_label.setdefault(str(payload.get("label") or path.name), []).append(payload)
            if not by_label:
                raise ValueError(f"{path} holds no benchmark point files")
            sets.extend(
                ResultSet(label, sorted(points, key=load_order))
                for label, points in by_label.items()
            )
            continue
        payload = json.loads(path.read_text())
        label = str(payload.get("label") or path.stem)
        if "points" in payload:
            sets.append(ResultSet(label, list(payload["points"])))
        elif "completed" in payload:
            sets.append(ResultSet(label, [payload]))
        else:
            raise ValueError(f"{path} is not a tandem bench result file")
    return sets


COMPARISON_FIELDS = (
    "request_rate",
    "max_concurrency",
    "completed",
    "failed",
    "request_throughput",
    "request_goodput",
    "slo_attainment",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "router_decisions",  # during the point (tandem bench compare)
)


def comparison_rows(result_sets: Sequence[ResultSet]) -> list[dict[str, Any]]:
    """One row per configuration and load point: the set's label and COMPARISON_FIELDS (None
    where a point has no such value)."""
    return [
        {"configuration": result_set.label, **{key: point.get(key) for key in COMPARISON_FIELDS}}
        for result_set in result_sets
        for point in result_set.points
    ]


def comparison_summary(
    result_sets: Sequence[ResultSet],
    commands: dict[str, list[str]],
    rows: Sequence[dict[str, Any]],
    decisions: dict[str, Any] | None = None,
    exit_codes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The content of compare.json: what ran (model, SLOs, each configuration's command, what
    its router decided over the sweep and, for a cluster that exited during it, its exit code)
    and the rows of `comparison_rows`."""
    decisions, exit_codes = decisions or {}, exit_codes or {}
    points = [point for result_set in result_sets for point in result_set.points]
    first = points[0] if points else {}
    return {
        "model_id": first.get("model_id"),
        "goodput_slos_ms": first.get("goodput_slos_ms"),
        "configurations": [
            {
                "label": result_set.label,
                "command": commands.get(result_set.label),
                "router_decisions": decisions.get(result_set.label),
                "exited_during_sweep": exit_codes.get(result_set.label),
            }
            for result_set in result_sets
        ],
        "rows": list(rows),
    }
