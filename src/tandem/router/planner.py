"""The planner: which duty each `auto` worker has now, from the workers' load reports.

An auto worker (`tandem worker --role auto`) takes prefill legs, decode legs and whole requests.
The planner gives each a duty, `prefill` (prefill legs) or `decode` (decode legs and whole
requests); a new one starts on `decode`, so auto workers alone are a colocated pool. After every
health round it makes at most one change, none within `planner_dwell_s` of the last. A queue is
the mean tokens waiting per worker of the side that prefills over the rounds since the last
change (at most `planner_dwell_s`); prefill workers are idle when each has had no request in
flight for `planner_idle_s` (their own count, `idle_ms`: a prefill step hides from the stats).

* an auto prefill worker goes back to `decode` when the decode side's KV use passes
  `planner_decode_kv_high` or the prefill side is idle;
* else, where at least two workers decode and decode has room, an auto decode worker takes up
  `prefill` when prompts slow a colocated pool's streams (no prefill worker, a TPOT p90 at
  `planner_decode_tpot_high_ms` or more, a queue at `planner_prefill_queue_low` or more, and
  the decode step the others would settle at with its arrivals too well under that mark) or the
  prefill workers fall behind (a queue over `planner_prefill_queue_high`).

Why: a split pays only where prefills slow decoding, else it halves prefill capacity; a TPOT
p90 at the SLO means 10% of streams miss it. Where steps are slow for the KV they read (a small
model's long contexts), fewer decode workers make each step slower, so streams last longer and
more overlap: the workers left settle where their line of step time against context meets the
context their arrivals keep in flight (engine/step_costs.py; a 0.6B pool at 28 req/s went from
6 to 19 ms a step, docs/benchmarks.md). A duty is a per-request choice: a change drains itself.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.router.config import RouterConfig
from tandem.router.metrics import RouterMetrics

if TYPE_CHECKING:
    from tandem.router.workers import Worker

DUTIES = ("prefill", "decode")
# a decode worker's streams' TPOT p90 over its mean step: the mark is a p90, the prediction a
# step (1.2 to 1.3 on the split 8B pool of docs/benchmarks.md's run J); it also leaves room for
# a prediction made while the streams still ramp up (0.6B in run J: 9.7 ms predicted, 20 after)
TPOT_P90_OVER_STEP = 1.25

logger = logging.getLogger("tandem.router")


class Planner:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._last_change = float("-inf")
        # (time, queue) of the rounds of the last dwell time since the last change
        self._rounds: deque[tuple[float, float]] = deque()
        self._refusing = False  # the last split the streams asked for was predicted not to pay

    def plan(self, workers: Sequence[Worker], now: float | None = None) -> None:
        """Assigns a duty to every auto worker among `workers` (those in the pool), changing at
        most one existing duty."""
        config = self._config
        now = time.monotonic() if now is None else now
        for worker in workers:
            if worker.role == "auto" and worker.assigned is None:
                self._assign(worker, "decode")
        self._rounds.append((now, prefill_queue(workers)))
        while self._rounds[0][0] < now - config.planner_dwell_s:
            self._rounds.popleft()
        if now - self._last_change < config.planner_dwell_s:
            return
        queue = sum(queue for _, queue in self._rounds) / len(self._rounds)
        change = self._change(workers, queue)
        if change is not None:
            worker, duty, why = change
            logger.info("planner: %s takes up %s (%s)", worker.url, duty, why)
            self._assign(worker, duty)
            self._metrics.role_changes.labels(duty).inc()
            self._last_change = now
            self._rounds.clear()

    def _change(self, workers: Sequence[Worker], queue: float) -> tuple[Worker, str, str] | None:
        """`queue`: the side that prefills, over the last rounds. The worker to move, its new
        duty and why."""
        config = self._config
        prefill = [worker for worker in workers if worker.serving_role == "prefill"]
        decode = [worker for worker in workers if worker.serving_role == "decode"]
        decode_kv = sum(w.load.kv_usage for w in decode) / len(decode) if decode else 0.0
        on_prefill = [worker for worker in prefill if worker.role == "auto"]
        idle = all(0 < w.load.idle_ms >= 1000 * config.planner_idle_s for w in prefill)
        if on_prefill and (decode_kv > config.planner_decode_kv_high or idle):
            why = "prefill side idle" if idle else f"decode KV use {decode_kv:.2f}"
            return min(on_prefill, key=lambda w: w.load.tokens_waiting), "decode", why
        on_decode = [worker for worker in decode if worker.role == "auto"]
        if not on_decode or len(decode) < 2 or decode_kv > config.planner_decode_kv_high:
            return None
        worker = min(on_decode, key=lambda w: (w.load.requests_running, w.outstanding))
        tpot_ms = max((w.load.tpot_p90_ms for w in decode), default=0)
        streams_slowed = (
            not prefill
            and config.streams_slowed(tpot_ms)
            and queue >= config.planner_prefill_queue_low
        )
        why = f"TPOT p90 {tpot_ms} ms, queue {queue:.0f} tokens a worker"
        refused = False
        if streams_slowed:
            step_after_ms = decode_step_after_split_ms(decode, worker)
            if step_after_ms is None:  # a load's first seconds: wait for them to tell
                why += ", the decode step then not known yet"
                refused = True
            else:
                self._metrics.split_step_ms.set(step_after_ms)
                if step_after_ms:
                    why += f", the decode step then {step_after_ms:.1f} ms"
                predicted_ms = step_after_ms * TPOT_P90_OVER_STEP
                refused = predicted_ms >= config.planner_decode_tpot_high_ms
            if refused and not self._refusing:
                logger.info("planner: no split (%s)", why)
        self._refusing = refused
        if streams_slowed and not refused:
            return worker, "prefill", why
        if prefill and queue > config.planner_prefill_queue_high:
            return worker, "prefill", f"prefill side behind: queue {queue:.0f} tokens a worker"
        return None

    def _assign(self, worker: Worker, duty: str) -> None:
        worker.assigned = duty  # type: ignore[assignment]
        for each in DUTIES:
            self._metrics.auto_duty.labels(worker.url, each).set(1 if each == duty else 0)


def decode_step_after_split_ms(decode: Sequence[Worker], leaving: Worker) -> float | None:
    """The decode step the decode workers left would settle at if `leaving` took up prefill:
    its arrivals' context (per microsecond of time per token, Little's law) spread over them,
    on each one's line; inf where a step would grow without end. 0 where they report no line
    (no prediction), None where a decode worker's context a microsecond is not known yet."""
    staying = [worker for worker in decode if worker is not leaving]
    if not staying or not all(w.load.decode_step_base_us for w in staying):
        return 0.0
    if not all(w.load.decode_token_interval_us for w in decode):
        return None
    context_per_token_us = sum(w.load.context_per_token_us for w in decode) / len(staying)
    return max(w.load.settled_decode_step_ms(context_per_token_us) for w in staying)


def prefill_queue(workers: Sequence[Worker]) -> float:
    """Tokens waiting per worker of the side that prefills (the prefill workers, or the decode
    workers while there are none)."""
    prefill = [worker for worker in workers if worker.serving_role == "prefill"]
    prefilling = prefill or [worker for worker in workers if worker.serving_role == "decode"]
    return sum(w.load.tokens_waiting for w in prefilling) / max(1, len(prefilling))
