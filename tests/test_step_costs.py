"""What decoding costs the engine (engine/step_costs.py): the line of decode step time against
context, fitted from the decode-only steps, and the latest decode steps' mean context and time,
against figures computed by hand, and recorded by a real engine core's steps."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.outputs import ScheduledRequest, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.step_costs import (
    MIN_STEPS,
    RATE_KNOWN_S,
    RATE_WINDOW_S,
    RECENT_STEPS,
    DecodeStepCosts,
)


def step(*requests: tuple[int, int]) -> SchedulerOutput:
    """A step of requests given as (tokens computed this step, tokens already in the cache)."""
    scheduled = [
        ScheduledRequest(f"r{i}", [7] * count, start, [], True, SamplingParams(), 0)
        for i, (count, start) in enumerate(requests)
    ]
    return SchedulerOutput(scheduled, sum(count for count, _ in requests))


START = 100.0  # the clock's first step
KNOWN = START + RATE_KNOWN_S  # the first time the context a microsecond is known


class Clock:
    """Feeds steps to a DecodeStepCosts, each lasting the given seconds."""

    def __init__(self, costs: DecodeStepCosts) -> None:
        self.costs = costs
        self.now = START

    def run(self, output: SchedulerOutput, seconds: float) -> None:
        self.costs.record(output, self.now)
        self.now += seconds


def test_the_line_through_decode_steps_is_the_least_squares_one():
    costs = DecodeStepCosts()
    clock = Clock(costs)
    contexts = [1000 + 100 * index for index in range(MIN_STEPS - 1)] + [10_000]
    for context in contexts:  # two requests, each with half of it less one in the cache
        clock.run(step((1, context // 2 - 1), (1, context // 2 - 1)), 0.002 + 3e-7 * context)
    # a step's time is known once the next starts: 31 of 32 so far, too few to tell
    assert costs.report(clock.now) == dict.fromkeys(
        ("decode_step_base_us", "decode_step_us_per_ktoken", "decode_context_tokens",
         "decode_token_interval_us"), 0,
    )  # fmt: skip
    clock.run(step((1, 5)), 0.001)
    # exactly on the line 2 ms + 0.3 us a token: the fit is that line
    report = costs.report(clock.now)
    assert report["decode_step_base_us"] == 2000
    assert report["decode_step_us_per_ktoken"] == 300
    # the context and time not yet: the steps go back less than RATE_KNOWN_S; then the 32
    # steps' mean context and mean time
    assert report["decode_context_tokens"] == report["decode_token_interval_us"] == 0
    report = costs.report(KNOWN)
    assert report["decode_context_tokens"] == round(sum(contexts) / len(contexts))
    mean_us = sum(2000 + 0.3 * context for context in contexts) / len(contexts)
    assert report["decode_token_interval_us"] == pytest.approx(mean_us, abs=1)


def test_steps_beside_a_prompt_chunk_count_in_the_rate_and_not_in_the_line():
    costs = DecodeStepCosts()
    clock = Clock(costs)
    for index in range(128):  # alternately: decode alone, and beside 512 prompt tokens
        clock.run(step((1, 999 + index % 7)), 0.001 + 1e-6 * (1000 + index % 7))
        clock.run(step((1, 999), (512, 0)), 0.050)
    clock.run(step((1, 999)), 0.001)
    report = costs.report(KNOWN)
    # the line: 1 ms + 1 us a token, from the decode-alone steps only (the 50 ms ones left out)
    assert report["decode_step_base_us"] == pytest.approx(1000, abs=1)
    assert report["decode_step_us_per_ktoken"] == 1000
    # the rate: every decoding step, the prompt's chunk's context left out of it (its tokens are
    # no stream's); the mean time half 2 ms and half 50 ms
    assert report["decode_context_tokens"] == pytest.approx(1001.5, abs=1)
    assert report["decode_token_interval_us"] == pytest.approx(26_001.5, abs=2)


def test_idle_time_after_the_last_stream_is_no_step():
    costs = DecodeStepCosts()
    clock = Clock(costs)
    for _ in range(MIN_STEPS):
        clock.run(step((1, 100)), 0.004)
    clock.run(step((1, 100)), 5.0)  # the last stream ends; nothing runs for 5 s
    clock.run(step((512, 0)), 0.2)  # a new prompt alone
    clock.run(step((1, 512)), 0.004)
    clock.run(step((1, 513)), 0.004)
    report = costs.report(KNOWN)
    assert report["decode_token_interval_us"] == 4000
    assert report["decode_step_base_us"] + report["decode_step_us_per_ktoken"] * 0.1 == 4000


def test_a_lull_does_not_hide_the_load_of_the_last_window():
    costs = DecodeStepCosts()
    clock = Clock(costs)
    for _ in range(100):  # 2 s of load: 100k tokens of context, 20 ms a step
        clock.run(step((1, 99_999)), 0.020)
    for _ in range(100):  # then a lull: the few streams left, 5k tokens, 2 ms a step
        clock.run(step((1, 4_999)), 0.002)
    clock.run(step((1, 4_999)), 0.002)
    report = costs.report(KNOWN)
    assert report["decode_context_tokens"] == (100 * 100_000 + 100 * 5_000) / 200
    assert report["decode_token_interval_us"] == pytest.approx(11_000, abs=1)
    # once the load's steps are RATE_WINDOW_S old, the lull's alone
    report = costs.report(START + 2.0 + RATE_WINDOW_S + 0.001)
    assert report["decode_context_tokens"] == 5_000
    assert report["decode_token_interval_us"] == pytest.approx(2_000, abs=1)
    assert costs.report(clock.now + RATE_WINDOW_S)["decode_token_interval_us"] == 0  # unknown


def test_old_steps_leave_the_window_and_a_negative_slope_reads_flat():
    costs = DecodeStepCosts()
    clock = Clock(costs)
    for index in range(MIN_STEPS + 1):  # noise: slower with less context
        clock.run(step((1, 1000 + 10 * index)), 0.004 - 1e-6 * index)
    report = costs.report(clock.now)
    assert report["decode_step_us_per_ktoken"] == 0
    # the mean of 4000 - 0 ... 31 us
    assert report["decode_step_base_us"] == pytest.approx(4000 - 15.5, abs=1)
    for index in range(RECENT_STEPS + 1):  # a second regime: 1 ms + 1 us a token
        context = 1000 * (index % 50) + 1
        clock.run(step((1, context - 1)), 0.001 + 1e-6 * context)
    report = costs.report(clock.now)
    assert report["decode_step_base_us"] == pytest.approx(1000, abs=1)
    assert report["decode_step_us_per_ktoken"] == 1000


def test_an_engine_core_records_each_step_as_it_starts(tiny_checkpoints):
    core = EngineCore(EngineConfig(model=str(tiny_checkpoints["llama-gqa"]), num_kv_blocks=64))
    try:
        recorded, starts = [], []
        record = core.decode_step_costs.record

        def spy(output: SchedulerOutput, started: float) -> None:
            recorded.append([(len(r.token_ids), r.start_position) for r in output.requests])
            starts.append(started)
            record(output, started)

        core.decode_step_costs.record = spy
        prompt = list(range(3, 40))
        core.add_request(Request("a", prompt, SamplingParams(max_tokens=MIN_STEPS + 3)))
        while core.has_work():
            core.step()
        # every step: the prompt's, then one token a step after it
        assert recorded == [[(len(prompt), 0)]] + [
            [(1, len(prompt) + index)] for index in range(MIN_STEPS + 2)
        ]
        # the line is known at once; the context a microsecond RATE_KNOWN_S after the first
        # decode step
        assert core.decode_step_costs.report(starts[1] + 1)["decode_token_interval_us"] == 0
        report = core.decode_step_costs.report(starts[1] + RATE_KNOWN_S)
        # 33 decode steps with a next one: contexts of the prompt and 1 to 33 tokens
        assert report["decode_context_tokens"] == len(prompt) + 17
        assert report["decode_token_interval_us"] > 0
        assert report["decode_step_base_us"] + report["decode_step_us_per_ktoken"] > 0
    finally:
        core.shutdown()


def test_a_line_with_a_negative_intercept_still_reads_as_known():
    """Step times on a line that crosses 0 at a context above 0: the base is 1 us, not 0,
    which the planner would read as no line at all."""
    costs = DecodeStepCosts()
    clock = Clock(costs)
    for index in range(MIN_STEPS + 1):  # -2 ms + 0.3 us a token: 1 ms at 10k tokens
        context = 10_000 + 1000 * index
        clock.run(step((1, context - 1)), -0.002 + 3e-7 * context)
    report = costs.report(clock.now)
    assert (report["decode_step_base_us"], report["decode_step_us_per_ktoken"]) == (1, 300)
