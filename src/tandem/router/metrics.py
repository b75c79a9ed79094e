"""Prometheus metrics of one router, kept in the router's own registry (no global state).

Outcomes of a request: `success`, `client_error` (a 4xx, the router's or a worker's),
`no_worker` (no worker could take it), `upstream_error` (a worker failed or timed out, before or
after the first byte), `aborted` (the client went away).

`tandem_router_added_seconds` is the router's own share of the time to the first byte: the time
from the request's arrival to its first byte sent, less the time spent waiting on workers.

Three are also kept under vLLM's names, with vLLM's label `model_name` (the request's model, else
the workers'), for dashboards and autoscalers made for vLLM: `vllm:request_success_total` and
`vllm:e2e_request_latency_seconds` count the requests answered in full (outcome `success`),
`vllm:time_to_first_token_seconds` the streamed ones' first token as the client gets it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tandem_router_requests",
            "Requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tandem_router_ttft_seconds",
            "Time from a streaming request's arrival to its first token sent.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tandem_router_e2e_seconds",
            "Time from a request's arrival to its last byte sent.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.added = Histogram(
            "tandem_router_added_seconds",
            "The router's own time before a request's first byte (waiting on workers excluded).",
            buckets=OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self.outstanding = Gauge(
            "tandem_router_worker_outstanding",
            "Requests in flight on each worker.",
            ["worker", "role"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "tandem_router_worker_healthy",
            "1 while a worker is in the pool, 0 while it is out.",
            ["worker", "role"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "tandem_router_refusals",
            "Leg attempts that a worker refused or dropped; the leg then tries another worker.",
            ["leg"],
            registry=self.registry,
        )
        self.kv_releases = Counter(
            "tandem_router_kv_releases",
            "Prefill leases the router released: requests given up between the legs, or "
            "answered by the prefill leg alone.",
            registry=self.registry,
        )
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from a streaming request's arrival to its first token sent.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's arrival to its last byte sent, for requests answered in full.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.vllm_success = Counter(
            "vllm:request_success",
            "Requests answered in full.",
            ["model_name"],
            registry=self.registry,
        )
        self.handoffs = Counter(
            "tandem_router_handoffs",
            "PD requests whose decode leg went out with the prefill leg (tandem's handoff flow) "
            "rather than after it.",
            registry=self.registry,
        )

        self.pd_decisions = Counter(
            "tandem_router_pd_decisions",
            "How each request that could be disaggregated was served (decision: disaggregated "
            "or whole), and why (decide.py).",
            ["decision", "reason"],
            registry=self.registry,
        )
        self.decode_prefix_tokens = Counter(
            "tandem_router_decode_prefix_tokens",
            "Prompt tokens (estimated) that the chosen decode worker holds already (hit) or not "
            "(miss), as the router's record of the prompts it sent each worker has it.",
            ["kind"],
            registry=self.registry,
        )
        self.auto_duty = Gauge(
            "tandem_router_auto_worker_duty",
            "1 for the duty an auto worker has now (prefill, or decode and whole requests).",
            ["worker", "duty"],
            registry=self.registry,
        )
        self.split_step_ms = Gauge(
            "tandem_router_planner_split_decode_step_ms",
            "The decode step the planner last predicted for a colocated pool split by one worker "
            "(+Inf: steps would grow without end); it splits only under the TPOT mark.",
            registry=self.registry,
        )
        self.role_changes = Counter(
            "tandem_router_role_changes",
            "Duty changes of auto workers made by the planner, by the duty taken up.",
            ["duty"],
            registry=self.registry,
        )

    def forget_worker(self, url: str, role: str) -> None:
        labels = [(self.outstanding, role), (self.healthy, role)]
        labels += [(self.auto_duty, duty) for duty in ("prefill", "decode")]
        for gauge, label in labels:
            try:
                gauge.remove(url, label)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
