"""The worker's Prometheus metrics, in a registry of its own (no process-global state).

Gauges mirror the engine core's latest stats; histograms and counters are fed by the HTTP layer
as responses progress, which also keeps the time per output token of the latest responses and of
the streams running now, and how long the worker has had no request, for the load report a
router reads on /health. The ones vLLM has are also shown under vLLM's names (`vllm:...`, label
`model_name`), for the dashboards and routers that read those: copied at each scrape, so
responses pay nothing for them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

# engine stat -> (gauge name, help)
STAT_GAUGES = {
    "kv_blocks_used": ("tandem_kv_cache_blocks_used", "KV blocks held by live requests and leases"),
    "kv_blocks_total": ("tandem_kv_cache_blocks_total", "KV blocks in the cache"),
    "requests_running": ("tandem_requests_running", "Requests in the running batch"),
    "requests_waiting": ("tandem_requests_waiting", "Requests waiting (incl. for remote KV)"),
    "tokens_waiting": ("tandem_prompt_tokens_waiting", "Prompt tokens admitted, not computed yet"),
    "prefix_cache_hit_rate": ("tandem_prefix_cache_hit_rate", "Prefix cache hit rate (tokens)"),
    "num_preemptions": ("tandem_preemptions", "Requests preempted so far"),
    "kv_blocks_leased": ("tandem_kv_blocks_leased", "Blocks held for remote decoders"),
    "kv_bytes_sent": ("tandem_kv_transfer_bytes_sent", "KV bytes sent to decoders"),
    "kv_bytes_received": ("tandem_kv_transfer_bytes_received", "KV bytes received"),
    "kv_blocks_sent": ("tandem_kv_transfer_blocks_sent", "KV blocks sent to decoders"),
    "kv_blocks_received": ("tandem_kv_transfer_blocks_received", "KV blocks received"),
}

# the engine stats a worker's /health reports as its load (what a router balances on)
LOAD_STATS = (
    "requests_running",
    "requests_waiting",
    "tokens_waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    # what decoding costs (engine/step_costs.py)
    "decode_step_base_us",
    "decode_step_us_per_ktoken",
    "decode_context_tokens",
    "decode_token_interval_us",
)

# the responses a load report's tpot_p90_ms is taken over: the last this many, of those that
# ended in the last RECENT_TPOTS_S seconds
RECENT_TPOTS = 1024
RECENT_TPOTS_S = 10.0
# the fewest responses a tpot_p90_ms is read from (0 with fewer): a burst of a few long prompts
# (a benchmark's warm-up) made the p90 of four responses their worst, and the planner split a
# pool that met its SLO
MIN_TPOT_SAMPLES = 10


class LiveStream(Protocol):
    """A response streaming its tokens now (writer.LatencyTracker)."""

    def tpot_so_far(self) -> float | None:
        """Its time per output token so far; None while too few tokens tell."""


# tandem's metric -> vLLM's name for the same (label renames beside)
VLLM_NAMES = {
    "tandem_requests_running": "vllm:num_requests_running",
    "tandem_requests_waiting": "vllm:num_requests_waiting",
    "tandem_prompt_tokens": "vllm:prompt_tokens",
    "tandem_generation_tokens": "vllm:generation_tokens",
    "tandem_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "tandem_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "tandem_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "tandem_requests": "vllm:request_success",
}
VLLM_LABELS = {"finish_reason": "finished_reason"}


class VllmNames:
    """A collector that shows some of a registry's metrics again under vLLM's names, and
    vLLM's KV cache usage (the fraction of blocks in use) from the block gauges."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        values = {}
        for family in self.source.collect():
            if family.name in ("tandem_kv_cache_blocks_used", "tandem_kv_cache_blocks_total"):
                values[family.name] = sum(sample.value for sample in family.samples)
            if (name := VLLM_NAMES.get(family.name)) is None:
                continue
            renamed = Metric(name, family.documentation, family.type)
            for sample in family.samples:
                labels = {VLLM_LABELS.get(key, key): value for key, value in sample.labels.items()}
                suffix = sample.name[len(family.name) :]
                renamed.samples.append(sample._replace(name=name + suffix, labels=labels))
            yield renamed
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV cache usage (1 means full)", labels=["model_name"]
        )
        total = values.get("tandem_kv_cache_blocks_total")
        used = values.get("tandem_kv_cache_blocks_used", 0.0)
        usage.add_metric([self.model_name], used / total if total else 0.0)
        yield usage


class WorkerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.gauges = {  # engine stat -> this model's gauge (labelled once, set per report)
            key: Gauge(name, doc, labels, registry=self.registry).labels(model_name)
            for key, (name, doc) in STAT_GAUGES.items()
        }
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Time between tokens of a response",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens processed", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Tokens generated", labels, registry=self.registry
        )
        self.requests = Counter(
            "tandem_requests",
            "Finished requests by finish reason",
            labels + ["finish_reason"],
            registry=self.registry,
        )
        self.kv_transfer_latency = Histogram(
            "tandem_kv_transfer_seconds",
            "Time to load one request's KV from a prefill worker",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kv_failures = Counter(
            "tandem_kv_transfer_failures",
            "KV transfers that failed, by kind",
            labels + ["kind"],
            registry=self.registry,
        )
        self.kv_bytes_served = Counter(
            "tandem_kv_transfer_bytes_served",
            "KV bytes decoders got of this worker's transfers (a partial transfer's blocks only)",
            labels,
            registry=self.registry,
        )
        self.kv_blocks_served = Counter(
            "tandem_kv_transfer_blocks_served",
            "KV blocks decoders got of this worker's transfers (a partial transfer's only)",
            labels,
            registry=self.registry,
        )
        self.load: dict[str, int] = {}  # the latest of LOAD_STATS, for a router (/health)
        # (end, time per output token) of the latest responses, for the load report's tpot_p90_ms
        self.recent_tpots: deque[tuple[float, float]] = deque(maxlen=RECENT_TPOTS)
        self.live_streams: set[LiveStream] = set()  # the one-choice responses running now
        self.requests_in_flight = 0  # responses begun and not ended
        self.last_request_end = time.monotonic()  # when the latest ended (at first: the start)
        self.vllm_names = CollectorRegistry()
        self.vllm_names.register(VllmNames(self.registry, model_name))

    def observe_tpot(self, now: float, seconds: float) -> None:
        """The time per output token of a response that ended at `now` (time.monotonic()): the
        time from its first token to its last over the tokens after the first."""
        self.recent_tpots.append((now, seconds))

    def request_began(self) -> None:
        self.requests_in_flight += 1

    def request_ended(self, now: float) -> None:
        self.requests_in_flight -= 1
        self.last_request_end = now

    def load_report(self, now: float) -> dict[str, int]:
        """What /health tells a router: LOAD_STATS; idle_ms, how long the worker has had no
        request in flight (0 while it has one: its own count, not the engine's latest stats,
        which a prefill step leaves unsent until its prompt is done); and tpot_p90_ms, the 90th
        percentile of the time per output token of the responses that ended in the last
        RECENT_TPOTS_S seconds and of those running now, so far (nearest rank; 0 with fewer
        than MIN_TPOT_SAMPLES of them):
        at or over a TPOT SLO, 10% of them or more miss it, which is what the planner compares
        with its mark. The running ones make it tell within a fraction of a second that prompts
        slow the streams, not once slowed responses have ended (seconds later)."""
        tpots = [tpot for at, tpot in self.recent_tpots if now - at <= RECENT_TPOTS_S]
        tpots += [tpot for tpot in (s.tpot_so_far() for s in self.live_streams) if tpot is not None]
        tpots.sort()
        p90_ms = 0
        if len(tpots) >= MIN_TPOT_SAMPLES:
            p90_ms = round(1000 * tpots[math.ceil(0.9 * len(tpots)) - 1])
        idle_ms = 0 if self.requests_in_flight else round(1000 * (now - self.last_request_end))
        return {**self.load, "idle_ms": idle_ms, "tpot_p90_ms": p90_ms}

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        """Apply one stats report of the engine core (each report is seen exactly once)."""
        queries = stats.get("prefix_cache_queries", 0)
        hit_rate = stats.get("prefix_cache_hits", 0) / queries if queries else 0.0
        stats = dict(stats, prefix_cache_hit_rate=hit_rate)
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.set(stats[key])
        self.load = {key: int(stats[key]) for key in LOAD_STATS if key in stats}
        for seconds in stats.get("kv_transfer_seconds", ()):
            self.kv_transfer_latency.labels(self.model_name).observe(seconds)
        for kind, count in stats.get("kv_transfer_failures", {}).items():
            self.kv_failures.labels(self.model_name, kind).inc(count)
        self.kv_bytes_served.labels(self.model_name).inc(stats.get("kv_bytes_served", 0))
        self.kv_blocks_served.labels(self.model_name).inc(stats.get("kv_blocks_served", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_names)
