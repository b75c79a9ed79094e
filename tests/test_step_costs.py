"""The engine's line of decode step time against context (engine/step_costs.py): fitted from the
decode-only steps, against lines computed by hand, and recorded by a real engine core's steps."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.outputs import ScheduledRequest, SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.step_costs import (
    CONTEXT_STEPS,
    MIN_STEPS,
    RECENT_STEPS,
    UNKNOWN,
    DecodeStepCosts,
)


def step(*requests: tuple[int, int]) -> SchedulerOutput:
    """A step of requests given as (tokens computed this step, tokens already in the cache)."""
    scheduled = [
        ScheduledRequest(f"r{i}", [7] * count, start, [], True, SamplingParams(), 0)
        for i, (count, start) in enumerate(requests)
    ]
    return SchedulerOutput(scheduled, sum(count for count, _ in requests))


def test_the_line_through_decode_steps_is_the_least_squares_one():
    costs = DecodeStepCosts()
    for index in range(MIN_STEPS - 1):
        context = 1000 + 100 * index  # two requests, each with half of it less one in the cache
        costs.record(step((1, context // 2 - 1), (1, context // 2 - 1)), 0.002 + 3e-7 * context)
    assert costs.report() == UNKNOWN  # too few steps to tell
    costs.record(step((1, 9999)), 0.002 + 3e-7 * 10_000)
    # exactly on the line 2 ms + 0.3 us a token: the fit is that line; the context, the mean of
    # the 32 steps (1000 ... 4000 by 100, and 10,000)
    contexts = [1000 + 100 * index for index in range(MIN_STEPS - 1)] + [10_000]
    assert costs.report() == {
        "decode_step_base_us": 2000,
        "decode_step_us_per_ktoken": 300,
        "decode_context_tokens": round(sum(contexts) / len(contexts)),
    }
    for _ in range(CONTEXT_STEPS):  # the context is that of the latest CONTEXT_STEPS steps
        costs.record(step((1, 9999)), 0.002 + 3e-7 * 10_000)
    assert costs.report()["decode_context_tokens"] == 10_000


def test_steps_with_prompt_tokens_are_left_out_and_old_steps_leave_the_window():
    costs = DecodeStepCosts()
    for index in range(RECENT_STEPS):  # a first regime: 5 ms flat
        costs.record(step((1, 100 + index)), 0.005)
    assert costs.report()["decode_step_base_us"] == 5000
    assert costs.report()["decode_step_us_per_ktoken"] == 0
    for index in range(RECENT_STEPS):
        costs.record(step((1, 100), (512, 0)), 1.0)  # a prompt chunk rides along: left out
        costs.record(step((1, 1000 * index)), 0.001 + 1e-6 * 1000 * index)
    # the first regime has left the window: 1 ms + 1 us a token (1000 us a thousand)
    report = costs.report()
    assert report["decode_step_base_us"] == pytest.approx(1000, abs=1)
    assert report["decode_step_us_per_ktoken"] == 1000


def test_noise_that_makes_the_slope_negative_reads_as_a_flat_line():
    costs = DecodeStepCosts()
    for index in range(MIN_STEPS):
        costs.record(step((1, 1000 + 10 * index)), 0.004 - 1e-6 * index)
    report = costs.report()
    assert report["decode_step_us_per_ktoken"] == 0
    # the mean of 4000 - 0 ... 4000 - 31 us
    assert report["decode_step_base_us"] == round(4000 - 15.5)


def test_an_engine_core_records_its_decode_steps_only(tiny_checkpoints):
    core = EngineCore(EngineConfig(model=str(tiny_checkpoints["llama-gqa"]), num_kv_blocks=64))
    try:
        recorded = []
        record = core.decode_step_costs.record

        def spy(output: SchedulerOutput, seconds: float) -> None:
            recorded.append(
                ([(len(r.token_ids), r.start_position) for r in output.requests], seconds)
            )
            record(output, seconds)

        core.decode_step_costs.record = spy
        prompt = list(range(3, 40))
        core.add_request(Request("a", prompt, SamplingParams(max_tokens=MIN_STEPS + 2)))
        while core.has_work():
            core.step()
        # every step was timed: the prompt's, then one token a step after it
        assert [requests for requests, _ in recorded] == [[(len(prompt), 0)]] + [
            [(1, len(prompt) + index)] for index in range(MIN_STEPS + 1)
        ]
        assert all(seconds > 0 for _, seconds in recorded)
        report = core.decode_step_costs.report()
        # the mean context of its 33 decode steps: the prompt and 1 to 33 tokens
        assert report["decode_context_tokens"] == len(prompt) + 17
        assert report["decode_step_base_us"] + report["decode_step_us_per_ktoken"] > 0
    finally:
        core.shutdown()
