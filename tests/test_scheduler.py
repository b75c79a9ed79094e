"""The scheduler without a model: budgets, chunked prefill, preemption, aborts, finish reasons.

`FakeModel` stands in for the runner. It keeps a paged "KV cache" of token ids, writes each
scheduled token into the slot its block table names, and "samples" a hash of the context it reads
back from those slots. So a wrong block table, a prefix hit on the wrong block or a block reused
while still in use changes the sampled tokens, and every finished request is compared with a
plain loop over the same hash (`reference_generation`), which knows nothing of blocks.

`Harness(async_scheduling=True)` plays the engine core's async scheduling: each step is
scheduled and run before the output of the one before is taken (the fake model takes a
SAMPLED_IN_FLIGHT token from its own last samples, as the runner does on the device).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from tandem.engine.kv_cache_manager import KVCacheManager, cdiv
from tandem.engine.outputs import (
    SAMPLED_IN_FLIGHT,
    EngineCoreOutput,
    HandedOffToken,
    KVConnectorOutput,
    RunnerOutput,
    SchedulerOutput,
)
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.kv.connector.base import KVConnectorScheduler, KVTransferParams, RequestView

EOS = 0
VOCAB = 40


def next_token(context: Sequence[int]) -> int:
    return hash(tuple(context)) % VOCAB


def reference_generation(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """The tokens and finish reason a request must end with, from the rules of SamplingParams."""
    output: list[int] = []
    while True:
        token = next_token(prompt + output)
        output.append(token)
        if len(output) >= params.min_tokens:
            if token == EOS and not params.ignore_eos:
                return output, "stop"
            if token in params.stop_token_ids:
                return output, "stop"
        if len(output) == params.max_tokens:
            return output, "length"


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.last_sampled: dict[str, int] = {}

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        size = self.block_size
        for item in scheduler_output.requests:  # write every request's new KV first ...
            assert len(item.block_ids) == cdiv(item.start_position + len(item.token_ids), size)
            assert len(set(item.block_ids)) == len(item.block_ids)
            for offset, token in enumerate(item.token_ids):
                if token == SAMPLED_IN_FLIGHT:
                    assert offset == len(item.token_ids) - 1
                    token = self.last_sampled[item.request_id]
                position = item.start_position + offset
                self.slots[item.block_ids[position // size] * size + position % size] = token
        sampled = {}
        for item in scheduler_output.requests:  # ... then read: no request may clobber another
            if item.sample:
                end = item.start_position + len(item.token_ids)
                context = [
                    self.slots[item.block_ids[p // size] * size + p % size] for p in range(end)
                ]
                sampled[item.request_id] = next_token(context)
        self.last_sampled = sampled
        return RunnerOutput(sampled)


class Harness:
    """A scheduler over a FakeModel, collecting each request's tokens and finish reason."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        connector: KVConnectorScheduler | None = None,
        policy: str = "fcfs",
        async_scheduling: bool = False,
    ) -> None:
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, policy=policy)
        self.kv = KVCacheManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.config, self.kv, connector)
        self.model = FakeModel(num_blocks, block_size)
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.requests: dict[str, Request] = {}
        self.num_chunks_without_sampling = 0
        self.async_scheduling = async_scheduling
        self.in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None

    def add(self, request_id: str, prompt: list[int], **params) -> Request:
        request = Request(
            request_id, prompt, SamplingParams(**params), eos_token_ids=frozenset({EOS})
        )
        self.requests[request_id] = request
        self.tokens[request_id] = []
        self.scheduler.add_request(request)
        return request

    def collect(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            assert output.request_id not in self.finish_reasons, "output after finishing"
            self.tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                self.finish_reasons[output.request_id] = output.finish_reason

    def schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        self.check_invariants(scheduler_output)
        return scheduler_output

    def step(
        self,
        between: Callable[[], None] | None = None,
        connector_output: KVConnectorOutput | None = None,
    ) -> SchedulerOutput:
        """One engine step: the connector's report first (as EngineCore.step takes it), then
        schedule; `between` runs after scheduling, before the outputs come back."""
        self.collect(self.scheduler.update_from_connector(connector_output))
        scheduler_output = self.schedule()
        runner_output = self.model.execute(scheduler_output)
        if between is not None:
            between()
        self.take_in_flight()  # the step before's, under async scheduling
        self.in_flight = scheduler_output, runner_output
        if not self.async_scheduling or scheduler_output.is_empty:
            self.take_in_flight()
        return scheduler_output

    def take_in_flight(self) -> None:
        """Take the output of the step in flight, as the engine core does."""
        if self.in_flight is not None:
            step, self.in_flight = self.in_flight, None
            self.scheduler.free_blocks_after_step()  # the step has ended
            self.collect(self.scheduler.update_from_output(*step))

    def has_work(self) -> bool:
        return self.in_flight is not None or self.scheduler.has_work()

    def abort(self, request_ids: list[str]) -> None:
        outputs = self.scheduler.abort_requests(request_ids)
        assert all(output.finish_reason == "abort" for output in outputs)
        self.collect(outputs)

    def run_until_idle(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise AssertionError("the scheduler made no progress")

    def check_invariants(self, scheduler_output: SchedulerOutput) -> None:
        counts = [len(item.token_ids) for item in scheduler_output.requests]
        assert all(count >= 1 for count in counts)
        assert scheduler_output.num_batched_tokens == sum(counts)
        assert sum(counts) <= self.config.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.config.max_num_seqs
        self.num_chunks_without_sampling += sum(
            not item.sample for item in scheduler_output.requests
        )
        for item in scheduler_output.requests:
            request = self.requests[item.request_id]
            assert request.status == RequestStatus.RUNNING
            end = item.start_position + len(item.token_ids)
            assert end == request.num_scheduled_tokens  # this step's tokens are in flight
            # a sample is in flight with them: it reaches past the known tokens by the samples
            # in flight before this one's
            num_ahead = request.num_tokens + request.num_in_flight_samples
            assert end == num_ahead - 1 if item.sample else end < num_ahead
            assert request.num_in_flight_samples <= 1 + self.async_scheduling
        # Every block's ref count is the number of requests holding it; free ones are queued.
        holders = [0] * self.kv.num_blocks
        for blocks in self.kv.req_blocks.values():
            for block in blocks:
                holders[block.block_id] += 1
        assert [block.ref_count for block in self.kv.pool.blocks] == holders
        assert set(self.kv.pool.free_queue) == {i for i, n in enumerate(holders) if n == 0}
        scheduler = self.scheduler
        live = set(scheduler.requests) | scheduler.held_for_remote | set(scheduler.freed_after_step)
        assert {rid for rid, blocks in self.kv.req_blocks.items() if blocks} <= live


def plan(scheduler_output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [
        (item.request_id, item.start_position, len(item.token_ids), item.sample)
        for item in scheduler_output.requests
    ]


def test_long_prompt_is_chunked_under_the_token_budget():
    harness = Harness(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=10)
    harness.add("a", list(range(1, 26)), max_tokens=3, ignore_eos=True)  # 25 tokens
    harness.add("b", list(range(30, 37)), max_tokens=2, ignore_eos=True)  # 7 tokens
    # Running requests spend the budget first, the waiting ones get what is left.
    expected = [
        [("a", 0, 10, False)],
        [("a", 10, 10, False)],
        [("a", 20, 5, True), ("b", 0, 5, False)],
        [("a", 25, 1, True), ("b", 5, 2, True)],
        [("a", 26, 1, True), ("b", 7, 1, True)],
    ]
    for step_plan in expected:
        assert plan(harness.step()) == step_plan
    assert not harness.scheduler.has_work()
    for request_id in ("a", "b"):
        request = harness.requests[request_id]
        assert (harness.tokens[request_id], harness.finish_reasons[request_id]) == (
            reference_generation(request.prompt_token_ids, request.sampling_params)
        )
    assert harness.kv.num_used_blocks == 0


def test_the_prompt_tokens_waiting_count_what_chunked_prefill_has_left():
    from tandem.engine.core_process import prompt_tokens_waiting

    harness = Harness(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=10)
    harness.add("a", list(range(1, 26)), max_tokens=3, ignore_eos=True)  # 25 tokens
    harness.add("b", list(range(30, 37)), max_tokens=2, ignore_eos=True)  # 7 tokens
    # The plan of the test above: a's prompt in chunks of 10, 10, 5, b's in 5 and 2.
    waiting = [prompt_tokens_waiting(harness.scheduler)]
    while harness.scheduler.has_work():
        harness.step()
        waiting.append(prompt_tokens_waiting(harness.scheduler))
    assert waiting == [25 + 7, 15 + 7, 5 + 7, 0 + 2, 0, 0]


def test_fully_cached_prompt_computes_only_its_last_token():
    harness = Harness(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(1, 10))  # 9 tokens: two full blocks, then one token
    harness.add("first", prompt, max_tokens=2, ignore_eos=True)
    harness.run_until_idle()
    again = harness.add("again", prompt, max_tokens=2, ignore_eos=True)
    assert plan(harness.step()) == [("again", 8, 1, True)]
    assert again.num_cached_tokens == 8
    exact = harness.add("exact", prompt[:8], max_tokens=2, ignore_eos=True)  # 8 = 2 full blocks
    assert plan(harness.step()) == [("again", 9, 1, True), ("exact", 4, 4, True)]
    assert exact.num_cached_tokens == 4  # the last block is recomputed for its last token
    harness.run_until_idle()
    assert harness.tokens["again"] == harness.tokens["first"]
    assert harness.kv.num_used_blocks == 0


def test_max_num_seqs_caps_the_running_set():
    harness = Harness(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abcd":
        harness.add(name, [ord(name), 1, 2], max_tokens=2, ignore_eos=True)
    steps = []
    while harness.scheduler.has_work():
        steps.append([item.request_id for item in harness.step().requests])
    assert steps == [["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]]
    assert all(len(harness.tokens[name]) == 2 for name in "abcd")


def test_newest_running_request_is_preempted_and_recomputed():
    harness = Harness(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = harness.add("a", list(range(1, 9)), max_tokens=7, ignore_eos=True)
    b = harness.add("b", list(range(11, 19)), max_tokens=9, ignore_eos=True)
    for _ in range(5):  # step 1: prompts in blocks 0-1 and 2-3; steps 2-5: decode into 4 and 5
        harness.step()
    assert harness.kv.block_ids("a") == [0, 1, 4]
    assert harness.kv.block_ids("b") == [2, 3, 5]
    assert a.num_computed_tokens == b.num_computed_tokens == 12

    # Position 12 opens a fourth block for each; none is free, so b (the newest) is preempted and
    # a takes b's freed tail block first.
    assert plan(harness.step()) == [("a", 12, 1, True)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert harness.scheduler.waiting[0] is b and b.num_preemptions == 1
    assert harness.kv.block_ids("a") == [0, 1, 4, 5]
    assert harness.kv.block_ids("b") == []
    assert b.num_output_tokens == 5

    # b's first two blocks are still cached but b needs 4 blocks and 2 are free: it waits.
    assert plan(harness.step()) == [("a", 13, 1, True)]
    assert harness.finish_reasons == {"a": "length"}

    # a's blocks are back; b hits its two cached prompt blocks and recomputes the rest of its
    # prompt and its 5 earlier outputs in one chunk, then samples its 6th token.
    step = harness.step()
    assert plan(step) == [("b", 8, 5, True)]
    assert step.requests[0].token_ids == b.all_token_ids[8:13]
    assert harness.kv.block_ids("b")[:2] == [2, 3]
    harness.run_until_idle()
    for request in (a, b):
        expected = reference_generation(request.prompt_token_ids, request.sampling_params)
        assert (harness.tokens[request.request_id], harness.finish_reasons[request.request_id]) == (
            expected
        )
    assert harness.scheduler.num_preemptions == 1
    assert harness.kv.num_used_blocks == 0


def test_preempted_requests_return_to_the_front_in_their_order():
    harness = Harness(num_blocks=8, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    for name in "abcd":
        harness.add(name, [ord(name), 1, 2, 3], max_tokens=8, ignore_eos=True)  # 2 blocks each
    harness.add("e", [9, 9], max_tokens=1)  # waits: no block is free after the first step
    harness.step()
    assert [r.request_id for r in harness.scheduler.waiting] == ["e"]
    # Step 2: each decode needs a third block. a's preempts d, whose two blocks serve a and b;
    # c's then preempts c itself. The older preempted request ends up first.
    assert plan(harness.step()) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert [r.request_id for r in harness.scheduler.waiting] == ["c", "d", "e"]
    harness.run_until_idle()
    assert harness.finish_reasons == {name: "length" for name in "abcde"}
    assert harness.kv.num_used_blocks == 0


@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["low", "high", "mid", "high2"]), ("priority", ["high", "high2", "mid", "low"])],
)
def test_the_policy_orders_waiting_requests(policy, order):
    """One sequence at a time: fcfs admits in arrival order, priority by priority (lower
    first), then arrival."""
    harness = Harness(16, 4, max_num_seqs=1, max_num_batched_tokens=64, policy=policy)
    for name, priority in (("low", 5), ("high", -1), ("mid", 0), ("high2", -1)):
        harness.add(name, [1, 2, 3], max_tokens=1, priority=priority)
    assert [plan(harness.step())[0][0] for _ in range(4)] == order
    assert harness.finish_reasons == dict.fromkeys(order, "length")


def test_the_priority_policy_preempts_the_least_urgent_running_request():
    """As in the fcfs test above, four requests fill the blocks and each decode then needs one
    more: under priority the least urgent (a) goes first, its blocks serve the two most urgent
    (b, d), and c preempts itself; they wait in order of priority, and all end as alone."""
    harness = Harness(8, 2, max_num_seqs=8, max_num_batched_tokens=64, policy="priority")
    for name, priority in (("a", 3), ("b", 0), ("c", 2), ("d", 1)):
        harness.add(name, [ord(name), 1, 2, 3], max_tokens=8, ignore_eos=True, priority=priority)
    assert sorted(plan(harness.step())) == [(name, 0, 4, True) for name in "abcd"]
    assert plan(harness.step()) == [("b", 4, 1, True), ("d", 4, 1, True)]
    assert [r.request_id for r in harness.scheduler.waiting] == ["c", "a"]
    harness.run_until_idle()
    for request in harness.requests.values():
        expected = reference_generation(request.prompt_token_ids, request.sampling_params)
        assert (harness.tokens[request.request_id], harness.finish_reasons[request.request_id]) == (
            expected
        )
    assert harness.kv.num_used_blocks == 0


def test_abort_frees_waiting_running_and_preempted_requests():
    harness = Harness(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    harness.add("running", list(range(1, 9)), max_tokens=20, ignore_eos=True)
    preempted = harness.add("preempted", list(range(11, 19)), max_tokens=20, ignore_eos=True)
    for _ in range(6):
        harness.step()
    assert preempted.status == RequestStatus.PREEMPTED
    harness.add("waiting", list(range(21, 30)), max_tokens=4)
    harness.step()
    assert [r.request_id for r in harness.scheduler.waiting] == ["preempted", "waiting"]
    assert harness.kv.num_used_blocks == 4

    harness.abort(["preempted"])
    assert [r.request_id for r in harness.scheduler.waiting] == ["waiting"]
    harness.abort(["waiting"])
    harness.abort(["running", "unknown-id"])
    assert harness.finish_reasons == dict.fromkeys(["preempted", "waiting", "running"], "abort")
    assert harness.kv.num_used_blocks == 0
    assert not harness.scheduler.has_work() and not harness.scheduler.has_unfinished_requests()


def test_abort_while_a_step_runs_drops_its_output():
    harness = Harness(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = harness.add("a", [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)
    harness.step()
    harness.add("b", [1, 2, 3, 4, 6], max_tokens=4, ignore_eos=True)
    harness.step()
    assert harness.kv.block_ids("b")[0] == harness.kv.block_ids("a")[0]  # a prefix hit
    assert harness.kv.num_used_blocks == 3
    harness.step(between=lambda: harness.abort(["a"]))
    expected = reference_generation(a.prompt_token_ids, a.sampling_params)[0]
    assert harness.tokens["a"] == expected[:2]
    assert harness.kv.num_used_blocks == 2  # b still holds the shared block
    harness.run_until_idle()
    assert harness.finish_reasons == {"a": "abort", "b": "length"}
    assert harness.kv.num_used_blocks == 0


def scripted(harness: Harness, script: dict[str, list[int]]) -> None:
    """Step until idle, each request 'sampling' the next token of its script."""
    while harness.scheduler.has_work():
        scheduler_output = harness.schedule()
        sampled = {
            item.request_id: script[item.request_id][item.output_index]
            for item in scheduler_output.requests
            if item.sample
        }
        harness.collect(
            harness.scheduler.update_from_output(scheduler_output, RunnerOutput(sampled))
        )


@pytest.mark.parametrize(
    ("params", "script", "expected_tokens", "finish_reason", "stop_reason"),
    [
        (dict(max_tokens=3), [5, 6, 7, 8], [5, 6, 7], "length", None),
        (dict(max_tokens=9), [5, EOS, 7], [5, EOS], "stop", None),
        (
            dict(max_tokens=4, ignore_eos=True),
            [5, EOS, EOS, 7, 8],
            [5, EOS, EOS, 7],
            "length",
            None,
        ),
        (dict(max_tokens=9, stop_token_ids=[7]), [5, 6, 7, 8], [5, 6, 7], "stop", 7),
        (dict(max_tokens=9, stop_token_ids=[7], ignore_eos=True), [EOS, 7], [EOS, 7], "stop", 7),
        # Before min_tokens outputs, neither EOS nor a stop id ends the request.
        (
            dict(max_tokens=9, min_tokens=3, stop_token_ids=[7]),
            [7, EOS, 5, 7],
            [7, EOS, 5, 7],
            "stop",
            7,
        ),
        (dict(max_tokens=9, min_tokens=2), [EOS, EOS], [EOS, EOS], "stop", None),
        (dict(max_tokens=2, min_tokens=2), [5, 6, 7], [5, 6], "length", None),
    ],
)
def test_finish_reasons(params, script, expected_tokens, finish_reason, stop_reason):
    harness = Harness(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    harness.add("r", [1, 2, 3], **params)
    outputs = []
    harness.collect = outputs.extend
    scripted(harness, {"r": script})
    assert [t for output in outputs for t in output.new_token_ids] == expected_tokens
    assert [output.finish_reason for output in outputs] == [None] * (len(outputs) - 1) + [
        finish_reason
    ]
    assert outputs[-1].stop_reason == stop_reason
    assert harness.kv.num_used_blocks == 0


def test_context_length_caps_the_output():
    harness = Harness(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    request = Request(
        "r", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=None), max_total_tokens=10
    )
    harness.requests["r"] = request
    harness.tokens["r"] = []
    harness.scheduler.add_request(request)
    scripted(harness, {"r": [5, 6, 7, 8]})
    assert harness.tokens["r"] == [5, 6] and harness.finish_reasons["r"] == "length"


def test_duplicate_request_id_is_refused():
    harness = Harness(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    harness.add("r", [1, 2])
    with pytest.raises(ValueError, match="already in use"):
        harness.add("r", [3, 4])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(4))
def test_random_mix_finishes_right_and_frees_every_block(seed, async_scheduling):
    rng = random.Random(seed)
    harness = Harness(
        num_blocks=12,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )
    shared_prefixes = [[rng.randrange(1, VOCAB) for _ in range(12)] for _ in range(3)]
    aborted: set[str] = set()

    def add(index: int) -> None:
        prefix = rng.choice(shared_prefixes)[: rng.randrange(0, 13)]
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 13))]
        max_tokens = rng.randrange(1, 13)
        harness.add(
            f"r{index}",
            prefix + tail,
            max_tokens=max_tokens,
            min_tokens=rng.choice([0, 0, rng.randrange(0, max_tokens + 1)]),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(1, VOCAB), rng.choice([0, 0, 1, 2])),
        )

    def abort_some(probability: float) -> None:
        live = list(harness.scheduler.requests)
        for request_id in live:
            if rng.random() < probability:
                aborted.add(request_id)
                harness.abort([request_id])

    num_added = 0
    for _ in range(250):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            add(num_added)
            num_added += 1
        abort_some(0.02)
        if harness.has_work():
            harness.step(between=lambda: abort_some(0.02))
    abort_some(0.2)
    harness.run_until_idle()

    assert harness.kv.num_used_blocks == 0
    assert not harness.scheduler.has_unfinished_requests()
    assert set(harness.finish_reasons) == set(harness.requests)
    for request_id, request in harness.requests.items():
        expected_tokens, expected_reason = reference_generation(
            request.prompt_token_ids, request.sampling_params
        )
        if request_id in aborted:
            assert harness.finish_reasons[request_id] == "abort"
            assert expected_tokens[: len(harness.tokens[request_id])] == harness.tokens[request_id]
        else:
            assert harness.tokens[request_id] == expected_tokens, request_id
            assert harness.finish_reasons[request_id] == expected_reason, request_id
    # The mix exercised what it is meant to.
    assert harness.scheduler.num_preemptions > 0
    assert harness.kv.num_prefix_hits > 0
    assert harness.num_chunks_without_sampling > 0
    assert len(aborted) > 0 and len(aborted) < num_added


class RemotePrefillConnector(KVConnectorScheduler):
    """A decode worker's connector (scheduler side), reduced to its bookkeeping: the KV of all
    but the last token of the `remote_ids` requests is elsewhere and is loaded once,
    asynchronously. The test plays the transfer: `deliver` writes the right tokens into the fake
    cache."""

    remote_tokens_cut = 1  # the prompt's last tokens not loaded

    def __init__(self, remote_ids: set[str]) -> None:
        self.remote_ids = remote_ids
        self.attempted: set[str] = set()
        self.loads: dict[str, tuple[list[int], int, int]] = {}  # block ids, first position, count

    def get_num_new_matched_tokens(self, request: RequestView, num_local: int) -> tuple[int, bool]:
        if request.request_id in self.remote_ids and request.request_id not in self.attempted:
            self.attempted.add(request.request_id)
            return request.num_prompt_tokens - self.remote_tokens_cut - num_local, True
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external: int
    ) -> None:
        first = request.num_prompt_tokens - self.remote_tokens_cut - num_external
        self.loads[request.request_id] = (list(block_ids), first, num_external)

    def deliver(self, harness: Harness, request_id: str) -> KVConnectorOutput:
        block_ids, first, count = self.loads.pop(request_id)
        size = harness.model.block_size
        tokens = harness.requests[request_id].all_token_ids
        for position in range(first, first + count):
            slot = block_ids[position // size] * size + position % size
            harness.model.slots[slot] = tokens[position]
        return KVConnectorOutput(finished_recving={request_id})


def test_remote_kv_counts_as_computed():
    connector = RemotePrefillConnector({"remote"})
    harness = Harness(16, 4, max_num_seqs=8, max_num_batched_tokens=64, connector=connector)
    local = harness.add("local", list(range(1, 10)), max_tokens=3, ignore_eos=True)
    harness.run_until_idle()
    # The first two blocks are cached: only tokens 8..12 of the 14 before the last come remotely.
    remote = harness.add("remote", list(range(1, 9)) + list(range(20, 27)), max_tokens=4)
    assert harness.step().requests == []
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert remote.num_computed_tokens == 8
    block_ids, first, count = connector.loads["remote"]
    assert (block_ids[:2], first, count) == ([0, 1], 8, 6)  # local's first blocks, hit
    assert len(block_ids) == 4  # 14 tokens
    # The step that takes the load's report schedules the request.
    delivered = connector.deliver(harness, "remote")
    assert plan(harness.step(connector_output=delivered)) == [("remote", 14, 1, True)]
    harness.run_until_idle()
    for request in (local, remote):
        assert (harness.tokens[request.request_id], harness.finish_reasons[request.request_id]) == (
            reference_generation(request.prompt_token_ids, request.sampling_params)
        )
    assert harness.kv.num_used_blocks == 0


def test_failed_remote_load_is_recomputed_from_scratch():
    """The failed request's blocks hold nothing valid. Meanwhile another request computed the
    same prompt, so the retry hits the prefix cache: its block table must start with those hits,
    not with the blocks the failed load never filled."""
    connector = RemotePrefillConnector({"remote"})
    harness = Harness(16, 4, max_num_seqs=8, max_num_batched_tokens=64, connector=connector)
    prompt = list(range(1, 10))
    remote = harness.add("remote", prompt, max_tokens=4, ignore_eos=True)
    local = harness.add("local", prompt, max_tokens=4, ignore_eos=True)
    assert plan(harness.step()) == [("local", 0, 9, True)]
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KV
    connector.loads.pop("remote")
    failed = KVConnectorOutput(failed_recving={"remote": "timeout"})
    step = harness.step(connector_output=failed)
    assert remote.status == RequestStatus.RUNNING
    assert plan(step) == [("local", 9, 1, True), ("remote", 8, 1, True)]
    assert step.requests[1].block_ids[:2] == harness.kv.block_ids("local")[:2]
    harness.run_until_idle()
    for request in (local, remote):
        assert (harness.tokens[request.request_id], harness.finish_reasons[request.request_id]) == (
            reference_generation(request.prompt_token_ids, request.sampling_params)
        )
    assert harness.kv.num_used_blocks == 0


def test_abort_while_waiting_for_remote_kv_frees_the_blocks():
    connector = RemotePrefillConnector({"remote"})
    harness = Harness(16, 4, max_num_seqs=8, max_num_batched_tokens=64, connector=connector)
    harness.add("remote", list(range(1, 10)), max_tokens=4)
    harness.step()
    assert harness.kv.num_used_blocks == 2
    harness.abort(["remote"])
    assert harness.finish_reasons == {"remote": "abort"}
    assert harness.kv.num_used_blocks == 0
    assert not harness.scheduler.has_work()


class HandoffConnector(RemotePrefillConnector):
    """A handoff's decode side: the whole prompt's KV comes remotely, and the first token with
    it (the test hands it over in KVConnectorOutput.first_tokens)."""

    remote_tokens_cut = 0


def add_handoff(harness: Harness, request_id: str, prompt: list[int], **params) -> Request:
    request = harness.add(request_id, prompt, **params)
    request.kv_transfer_params = KVTransferParams(
        do_remote_prefill=True, handoff_id=f"h-{request_id}"
    )
    return request


def test_a_handed_off_first_token_is_output_before_decoding_goes_on():
    connector = HandoffConnector({"remote"})
    harness = Harness(16, 4, max_num_seqs=8, max_num_batched_tokens=64, connector=connector)
    prompt = list(range(1, 11))
    remote = add_handoff(harness, "remote", prompt, max_tokens=5, ignore_eos=True)
    harness.step()
    block_ids, first, count = connector.loads["remote"]
    assert (first, count) == (0, 10)  # the whole prompt
    delivered = connector.deliver(harness, "remote")
    delivered.first_tokens["remote"] = HandedOffToken(next_token(prompt))
    # Output with the step that takes the report, which also computes the next token.
    assert plan(harness.step(connector_output=delivered)) == [("remote", 10, 1, True)]
    assert harness.tokens["remote"][0] == next_token(prompt)
    harness.run_until_idle()
    expected = reference_generation(prompt, remote.sampling_params)
    assert (harness.tokens["remote"], harness.finish_reasons["remote"]) == expected
    assert harness.kv.num_used_blocks == 0


def test_a_first_token_that_ended_the_request_at_prefill_ends_it_here():
    connector = HandoffConnector({"remote"})
    harness = Harness(16, 4, max_num_seqs=8, max_num_batched_tokens=64, connector=connector)
    add_handoff(harness, "remote", list(range(1, 11)), max_tokens=5, stop_token_ids=[7])
    harness.step()
    connector.loads.pop("remote")
    handed_off = {"remote": HandedOffToken(7, "stop", 7)}
    harness.step(connector_output=KVConnectorOutput({"remote"}, first_tokens=handed_off))
    assert (harness.tokens["remote"], harness.finish_reasons["remote"]) == ([7], "stop")
    assert not harness.scheduler.has_work()
    assert harness.kv.num_used_blocks == 0


def test_a_failed_handoff_is_recomputed_only_with_its_first_token():
    """Without the prefill's first token a recompute could sample another one than the client
    was sent: that request fails. With it, the token is output and the prompt recomputed."""
    connector = HandoffConnector({"unannounced", "announced"})
    harness = Harness(16, 4, max_num_seqs=8, max_num_batched_tokens=64, connector=connector)
    prompt = list(range(1, 11))
    add_handoff(harness, "unannounced", prompt, max_tokens=3, ignore_eos=True)
    announced = add_handoff(harness, "announced", prompt[::-1], max_tokens=3, ignore_eos=True)
    harness.step()
    connector.loads.clear()
    failed = KVConnectorOutput(
        failed_recving={"unannounced": "aborted", "announced": "connection"},
        first_tokens={"announced": HandedOffToken(next_token(prompt[::-1]))},
    )
    # The prompt and the first token are recomputed from the step that takes the report.
    assert plan(harness.step(connector_output=failed)) == [("announced", 0, 11, True)]
    assert harness.finish_reasons == {"unannounced": "error"}
    assert harness.tokens["announced"][0] == next_token(prompt[::-1])
    harness.run_until_idle()
    expected = reference_generation(prompt[::-1], announced.sampling_params)
    assert (harness.tokens["announced"], harness.finish_reasons["announced"]) == expected
    assert harness.kv.num_used_blocks == 0
