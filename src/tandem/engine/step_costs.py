"""What decoding costs the engine, for a router's planner: how long a decode step takes against
the context it reads, and how much context its streams read a microsecond.

A decode step's time, start to the next step's start, is fitted to a least-squares line, time =
base + per_token x context tokens, over the recent steps that computed no prompt token (every
request one token). Beside it, over the decode steps (alone or beside a prompt chunk) of the
last RATE_WINDOW_S, their mean context and mean time, the streams' time per token. By Little's
law the ratio, context read a microsecond, follows the arrivals, not how fast the steps run: a
planner splitting a colocated pool gives the workers left the ratio of those that leave and
finds the step each would settle at (router/planner.py). Dynamo's planner interpolates from an
offline profile; this learns while serving.

Invariant: each figure is 0 (unknown) until MIN_STEPS steps are behind it, the context and
time until the window's steps go back RATE_KNOWN_S too; a slope the noise makes negative reads
as 0 (a flat line through the mean), and a known line's base is at least 1 us (one whose
intercept is negative would read as unknown). A step time only counts where the next step
decoded too: a step after which no stream was left is followed by idle time, not by work.
"""

from __future__ import annotations

import time
from collections import deque

from tandem.engine.outputs import SchedulerOutput

RECENT_STEPS = 1024  # a few seconds of decoding: contexts vary as requests come and go
# the window of the context read a microsecond: that of the workers' TPOT p90 (server/metrics.py),
# which says when a split is asked for; a shorter one read the few streams left between two
# bursts as the load, and the planner split on a lull
RATE_WINDOW_S = 10.0
# and they are known once the window's steps go back this far: the first seconds of a load read
# low (its streams have not all arrived), and a 0.6B pool split on them (9.7 and 7.4 ms
# predicted, 20 after)
RATE_KNOWN_S = 8.0
MIN_STEPS = 32


class DecodeStepCosts:
    """The line's sums over the recent decode-alone steps, and the sums of the last
    RATE_WINDOW_S's decode steps' context and time, kept as steps come and go (each step's stats
    carry the report: it must cost nothing)."""

    def __init__(self) -> None:
        self._line_steps: deque[tuple[int, float]] = deque()  # (context, micros), decode alone
        self._line_sums = [0.0, 0.0, 0.0, 0.0]  # context, micros, context^2, context x micros
        self._rate_steps: deque[tuple[float, int, float]] = deque()  # (started, context, micros)
        self._rate_sums = [0, 0.0]  # context, micros
        self._last: tuple[float, int, bool] | None = None  # the last step that decoded

    def record(self, scheduler_output: SchedulerOutput, started: float) -> None:
        """A step about to run, started at `started` (seconds, a monotonic clock)."""
        requests = scheduler_output.requests
        context = sum(r.start_position + 1 for r in requests if len(r.token_ids) == 1)
        if self._last is not None and context:
            last_started, last_context, decoded_alone = self._last
            step = (last_context, (started - last_started) * 1e6)
            self._rate_steps.append((last_started, *step))
            self._rate_sums[0] += step[0]
            self._rate_sums[1] += step[1]
            self._forget_rate_steps(started)
            if decoded_alone:
                self._add_to_line(step)
        decoded_alone = bool(requests) and scheduler_output.num_batched_tokens == len(requests)
        self._last = (started, context, decoded_alone) if context else None

    def _forget_rate_steps(self, now: float) -> None:
        steps = self._rate_steps
        while steps and steps[0][0] < now - RATE_WINDOW_S:
            _, context, micros = steps.popleft()
            self._rate_sums[0] -= context
            self._rate_sums[1] -= micros

    def _add_to_line(self, step: tuple[int, float]) -> None:
        self._line_steps.append(step)
        self._sum(step, 1)
        if len(self._line_steps) > RECENT_STEPS:
            self._sum(self._line_steps.popleft(), -1)

    def _sum(self, step: tuple[int, float], sign: int) -> None:
        context, micros = step
        for index, value in enumerate((context, micros, context * context, context * micros)):
            self._line_sums[index] += sign * value

    def report(self, now: float | None = None) -> dict[str, int]:
        """decode_step_base_us and decode_step_us_per_ktoken (the line), decode_context_tokens
        and decode_token_interval_us (the mean context and time of the last RATE_WINDOW_S's
        decode steps) as of `now` (the clock of `record`)."""
        report = {"decode_step_base_us": 0, "decode_step_us_per_ktoken": 0}
        count = len(self._line_steps)
        if count >= MIN_STEPS:
            context, micros, context_squared, cross = (total / count for total in self._line_sums)
            variance = context_squared - context * context
            slope = max(0.0, (cross - context * micros) / variance) if variance > 0 else 0.0
            report["decode_step_base_us"] = max(1, round(micros - slope * context))
            report["decode_step_us_per_ktoken"] = round(slope * 1000)
        now = time.monotonic() if now is None else now
        self._forget_rate_steps(now)
        steps = self._rate_steps
        known = len(steps) >= MIN_STEPS and steps[0][0] <= now - RATE_KNOWN_S
        report["decode_context_tokens"] = round(self._rate_sums[0] / len(steps)) if known else 0
        report["decode_token_interval_us"] = round(self._rate_sums[1] / len(steps)) if known else 0
        return report
