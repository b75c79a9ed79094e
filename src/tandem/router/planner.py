"""The planner: which duty each `auto` worker has now, from the workers' load reports.

An auto worker (`tandem worker --role auto`: its KV server and KV client both on) can take
prefill legs, decode legs and whole requests. The planner gives each one a duty, and the router
sends it only that work: `prefill` (prefill legs) or `decode` (decode legs, and whole requests,
which it prefills itself). A new auto worker starts on `decode`, so a pool of auto workers alone
is a colocated pool. After every health round the planner makes at most one change, and none
within `planner_dwell_s` of the last. A queue below is the mean tokens waiting per worker over
the rounds of the last `planner_dwell_s` since the last change (one round's sample swings
between a whole prompt and none):

* one auto worker goes back to `decode` when the decode side's KV cache use passes
  `planner_decode_kv_high`, or the prefill workers' queue falls under `planner_prefill_queue_low`;
* else one auto `decode` worker takes up `prefill`, where at least two workers decode and
  decode has room, when prompt chunks slow the streams of a pool that prefills where it decodes
  (no prefill worker; a decode worker's TPOT p90 at `planner_decode_tpot_high_ms` or more, and
  its queue at `planner_prefill_queue_low` or more), or when the prefill workers fall behind
  (their queue above `planner_prefill_queue_high`).

Why a TPOT percentile: splitting pays only where prefills slow decoding; where colocated keeps
its TPOT SLO a split only halves prefill capacity (on two and four GPUs the queue-only moves
cost goodput; docs/benchmarks.md). The p90 at the SLO is the point where 10% of streams miss it.

A duty is a per-request choice for an auto worker, so a change drains by itself: the requests in
flight on it finish where they are, and only new legs follow the new duty. Nothing is lost.
"""

from __future__ import annotations

import time
from collections import deque
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
        self._queues: deque[tuple[float, float]] = deque()  # (time, queue) since the last change

    def plan(self, workers: Sequence[Worker], now: float | None = None) -> None:
        """Assigns a duty to every auto worker among `workers` (those in the pool), changing at
        most one existing duty."""
        now = time.monotonic() if now is None else now
        for worker in workers:
            if worker.role == "auto" and worker.assigned is None:
                self._assign(worker, "decode")
        self._queues.append((now, prefill_queue(workers)))
        while self._queues[0][0] < now - self._config.planner_dwell_s:
            self._queues.popleft()
        if now - self._last_change < self._config.planner_dwell_s:
            return
        queue = sum(sample for _, sample in self._queues) / len(self._queues)
        change = self._change(workers, queue)
        if change is not None:
            worker, duty = change
            self._assign(worker, duty)
            self._metrics.role_changes.labels(duty).inc()
            self._last_change = now
            self._queues.clear()

    def _change(self, workers: Sequence[Worker], queue: float) -> tuple[Worker, str] | None:
        """`queue`: the prefilling workers' mean tokens waiting over the last rounds."""
        config = self._config
        prefill = [worker for worker in workers if worker.serving_role == "prefill"]
        decode = [worker for worker in workers if worker.serving_role == "decode"]
        decode_kv = sum(w.load.kv_usage for w in decode) / len(decode) if decode else 0.0
        on_prefill = [worker for worker in prefill if worker.role == "auto"]
        if on_prefill and (
            decode_kv > config.planner_decode_kv_high or queue < config.planner_prefill_queue_low
        ):
            return min(on_prefill, key=lambda w: w.load.tokens_waiting), "decode"
        on_decode = [worker for worker in decode if worker.role == "auto"]
        if not on_decode or len(decode) < 2 or decode_kv > config.planner_decode_kv_high:
            return None
        tpot_ms = max((w.load.tpot_p90_ms for w in decode), default=0)
        streams_slowed = (
            not prefill
            and 0 < config.planner_decode_tpot_high_ms <= tpot_ms
            and queue >= config.planner_prefill_queue_low
        )
        if streams_slowed or (prefill and queue > config.planner_prefill_queue_high):
            return min(on_decode, key=lambda w: (w.load.requests_running, w.outstanding)), "prefill"
        return None

    def _assign(self, worker: Worker, duty: str) -> None:
        worker.assigned = duty  # type: ignore[assignment]
        for each in DUTIES:
            self._metrics.auto_duty.labels(worker.url, each).set(1 if each == duty else 0)


def prefill_queue(workers: Sequence[Worker]) -> float:
    """Tokens waiting per worker of the side that prefills: the prefill workers, or the decode
    workers while there are none."""
    prefill = [worker for worker in workers if worker.serving_role == "prefill"]
    prefilling = prefill or [worker for worker in workers if worker.serving_role == "decode"]
    return sum(w.load.tokens_waiting for w in prefilling) / max(1, len(prefilling))
