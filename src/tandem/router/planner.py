"""The planner: which duty each `auto` worker has now, from the workers' load reports.

An auto worker (`tandem worker --role auto`: its KV server and KV client both on) can take
prefill legs, decode legs and whole requests. The planner gives each one a duty, and the router
sends it only that work: `prefill` (prefill legs) or `decode` (decode legs, and whole requests,
which it prefills itself). A new auto worker starts on `decode`, so a pool of auto workers alone
is a colocated pool. After every health round the planner makes at most one change, and none
within `planner_dwell_s` of the last:

* one auto worker goes back to `decode` when the decode side's KV cache use passes
  `planner_decode_kv_high` (decoding is short of room), or when the prefill side's tokens waiting
  per worker fall under `planner_prefill_queue_low` (prefill capacity idles);
* else one auto `decode` worker takes up `prefill` when the tokens waiting per worker of the
  side that prefills (the prefill workers, or the decode side while there are none) pass
  `planner_prefill_queue_high`, a decode worker's inter-token latency (mean of its last seconds)
  is at least `planner_decode_itl_high_ms` (0: not asked for), at least two workers serve
  decode, and decode has room.

Why the latency too: a worker moved to prefill takes prefill capacity from a cluster whose queue
says it is short of it; a split pays only where prompt chunks slow the streams (on two and four
GPUs the queue-only moves cost goodput while colocated kept its TPOT SLO; docs/benchmarks.md).

A duty is a per-request choice for an auto worker, so a change drains by itself: the requests in
flight on it finish where they are, and only new legs follow the new duty. Nothing is lost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.router.config import RouterConfig
from tandem.router.metrics import RouterMetrics

if TYPE_CHECKING:
    from tandem.router.workers import Worker

DUTIES = ("prefill", "decode")


class Planner:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._last_change = float("-inf")

    def plan(self, workers: Sequence[Worker], now: float | None = None) -> None:
        """Assigns a duty to every auto worker among `workers` (those in the pool), changing at
        most one existing duty."""
        now = time.monotonic() if now is None else now
        for worker in workers:
            if worker.role == "auto" and worker.assigned is None:
                self._assign(worker, "decode")
        if now - self._last_change < self._config.planner_dwell_s:
            return
        change = self._change(workers)
        if change is not None:
            worker, duty = change
            self._assign(worker, duty)
            self._metrics.role_changes.labels(duty).inc()
            self._last_change = now

    def _change(self, workers: Sequence[Worker]) -> tuple[Worker, str] | None:
        config = self._config
        prefill = [worker for worker in workers if worker.serving_role == "prefill"]
        decode = [worker for worker in workers if worker.serving_role == "decode"]
        decode_kv = sum(w.load.kv_usage for w in decode) / len(decode) if decode else 0.0
        prefilling = prefill or decode  # with no prefill worker, decode workers prefill
        queue = sum(w.load.tokens_waiting for w in prefilling) / max(1, len(prefilling))
        on_prefill = [worker for worker in prefill if worker.role == "auto"]
        if on_prefill and (
            decode_kv > config.planner_decode_kv_high or queue < config.planner_prefill_queue_low
        ):
            return min(on_prefill, key=lambda w: w.load.tokens_waiting), "decode"
        on_decode = [worker for worker in decode if worker.role == "auto"]
        decode_itl_ms = max((w.load.itl_mean_ms for w in decode), default=0)
        if (
            on_decode
            and len(decode) >= 2
            and queue > config.planner_prefill_queue_high
            and decode_itl_ms >= config.planner_decode_itl_high_ms
            and decode_kv <= config.planner_decode_kv_high
        ):
            return min(on_decode, key=lambda w: (w.load.requests_running, w.outstanding)), "prefill"
        return None

    def _assign(self, worker: Worker, duty: str) -> None:
        worker.assigned = duty  # type: ignore[assignment]
        for each in DUTIES:
            self._metrics.auto_duty.labels(worker.url, each).set(1 if each == duty else 0)
