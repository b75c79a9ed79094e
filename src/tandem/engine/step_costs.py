"""What a decode step costs the engine as a function of the context it reads: a least-squares
line, step = base + per_token x context tokens, over its recent steps that computed no prompt
token (every request one token).

A router's planner reads it from the load report to predict what splitting a colocated pool
does to its streams: those of the worker that takes up prefill move to the others, which then
read more KV a step (router/planner.py). Where a step's time is mostly KV reads (a small model's
long contexts), a split doubles it on two workers; where it is mostly the weights (a large
model's few streams), it barely moves. Dynamo's planner interpolates the same from an offline
profile; this one learns it while serving.

Invariant: `report()` is all zeros (unknown) until MIN_STEPS steps are recorded; a slope the
noise makes negative is read as 0 (a flat line through the mean).
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque

from tandem.engine.outputs import SchedulerOutput

RECENT_STEPS = 1024  # a few seconds of decoding: contexts vary as requests come and go
MIN_STEPS = 32
# the context reported is the mean of the latest this many decode steps: one step's can be a
# request or two between prompt chunks, and a planner read a 4k context of a worker holding 150k
CONTEXT_STEPS = 64
UNKNOWN = {"decode_step_base_us": 0, "decode_step_us_per_ktoken": 0, "decode_context_tokens": 0}


class DecodeStepCosts:
    """The line's sums over the recent decode steps, kept as steps come and go (each step
    reports its stats: a fit must cost nothing)."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque()
        self._sums = [0.0, 0.0, 0.0, 0.0]  # context, micros, context^2, context x micros

    def record(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """One step that took `seconds`; kept only if it decoded alone."""
        requests = scheduler_output.requests
        if not requests or scheduler_output.num_batched_tokens != len(requests):
            return  # a prompt chunk rode along (every request computes a token or more)
        step = (sum(request.start_position + 1 for request in requests), seconds * 1e6)
        self._steps.append(step)
        self._add(step, 1)
        if len(self._steps) > RECENT_STEPS:
            self._add(self._steps.popleft(), -1)

    def _add(self, step: tuple[int, float], sign: int) -> None:
        context, micros = step
        for index, value in enumerate((context, micros, context * context, context * micros)):
            self._sums[index] += sign * value

    def report(self) -> dict[str, int]:
        """decode_step_base_us, decode_step_us_per_ktoken (the line) and
        decode_context_tokens (the mean context of the latest CONTEXT_STEPS decode steps)."""
        count = len(self._steps)
        if count < MIN_STEPS:
            return dict(UNKNOWN)
        latest = [context for context, _ in itertools.islice(reversed(self._steps), CONTEXT_STEPS)]
        context, micros, context_squared, cross = (total / count for total in self._sums)
        variance = context_squared - context * context
        slope = max(0.0, (cross - context * micros) / variance) if variance > 0 else 0.0
        return {
            "decode_step_base_us": round(max(0.0, micros - slope * context)),
            "decode_step_us_per_ktoken": round(slope * 1000),
            "decode_context_tokens": round(statistics.fmean(latest)),
        }
