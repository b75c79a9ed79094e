"""Benchmark arithmetic: request records of one load point in, vLLM-named summary fields out.

Definitions (all over successful requests; failed ones only count in `failed`):
* ttft: first content-bearing chunk - start; ttst: second content-bearing chunk - start.
* itl: every gap between consecutive content-bearing chunks, pooled over requests.
* tpot: (e2el - ttft) / (output_tokens - 1) per request with at least two output tokens.
* e2el: arrival of the last bytes - start.
* throughputs divide by the wall-clock `duration` of the whole point.
* goodput: requests meeting every SLO per second (tpot counts as 0 for one-token outputs);
  slo_attainment: the fraction of the requests sent (failed ones miss) that meet every SLO.
* percentiles interpolate linearly (numpy's default); std is the population std; a statistic of
  an empty set is None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.bench.client import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "ttst")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
MS_PER_S = 1000.0


def percentile_key(metric: str, percentile: float) -> str:
    """`p99_ttft_ms`, `p99.9_itl_ms`: vLLM's field names."""
    word = str(int(percentile)) if float(percentile).is_integer() else str(percentile)
    return f"p{word}_{metric}_ms"


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> `{"ttft": 200.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, _, value = pair.partition(":")
        try:
            slo_ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS pairs, got {pair!r}") from None
        if name not in GOODPUT_METRICS or slo_ms < 0:
            raise ValueError(
                f"--goodput {pair!r}: the name must be one of {', '.join(GOODPUT_METRICS)} and "
                "the value a non-negative number of milliseconds"
            )
        slos[name] = slo_ms
    return slos


def metric_values_ms(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """The samples of one latency metric over successful records, in milliseconds."""
    values: list[float] = []
    for record in records:
        if not record.success:
            continue
        if metric == "itl":
            values.extend(record.itl)
        else:
            value = getattr(record, metric)
            if value is not None:
                values.append(value)
    return [value * MS_PER_S for value in values]


def summarize(values: Sequence[float], metric: str, percentiles: Sequence[float]) -> dict[str, Any]:
    if not values:
        stats: dict[str, Any] = {f"{kind}_{metric}_ms": None for kind in ("mean", "median", "std")}
        stats.update({percentile_key(metric, p): None for p in percentiles})
        return stats
    array = np.asarray(values, dtype=float)
    stats = {
        f"mean_{metric}_ms": float(np.mean(array)),
        f"median_{metric}_ms": float(np.median(array)),
        f"std_{metric}_ms": float(np.std(array)),
    }
    stats.update({percentile_key(metric, p): float(np.percentile(array, p)) for p in percentiles})
    return stats


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    observed = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(
        observed[name] is not None and observed[name] * MS_PER_S <= slo
        for name, slo in slos_ms.items()
    )


def peak_output_rate(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """Most content chunks in one whole second since the first start, and the most requests
    in flight during any one second (vLLM's `max_output_tokens_per_s`, `max_concurrent_requests`).
    """
    succeeded = [record for record in records if record.success]
    if not succeeded:
        return 0.0, 0
    origin = min(record.start_time for record in succeeded)
    num_seconds = math.ceil(max(record.end_time for record in succeeded) - origin) + 1
    tokens_per_second = np.zeros(num_seconds)
    requests_per_second = np.zeros(num_seconds)
    for record in succeeded:
        for arrival in record.content_times:
            tokens_per_second[int(arrival - origin)] += 1
        first_second, last_second = int(record.start_time - origin), int(record.end_time - origin)
        requests_per_second[first_second : last_second + 1] += 1
    return float(tokens_per_second.max()), int(requests_per_second.max())


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Sequence[float] = (90.0, 99.0),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The summary fields of one load point, named as `vllm bench serve` names them."""
    succeeded = [record for record in records if record.success]
    total_input = sum(record.prompt_tokens for record in succeeded)
    total_output = sum(record.output_tokens for record in succeeded)
    peak_tokens_per_s, peak_concurrency = peak_output_rate(records)
    goodput = slo_attainment = None
    if goodput_slos_ms:
        num_good = sum(meets_slos(record, goodput_slos_ms) for record in succeeded)
        goodput = num_good / duration
        slo_attainment = num_good / len(records) if records else None
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(succeeded),
        "failed": len(records) - len(succeeded),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(succeeded) / duration,
        "request_goodput": goodput,
        "slo_attainment": slo_attainment,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tokens_per_s,
        "max_concurrent_requests": peak_concurrency,
    }
    for metric in LATENCY_METRICS:
        result.update(summarize(metric_values_ms(records, metric), metric, percentiles))
    return result
