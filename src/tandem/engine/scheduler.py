"""Continuous batching with chunked prefill, prefix caching, preemption and remote KV.

Each step spends a token budget (`max_num_batched_tokens`) first on running requests, oldest first,
then on waiting ones. A request asks for `num_tokens - num_computed_tokens` tokens; a long prompt
gets what is left of the budget and continues next step (chunked prefill). When blocks run out,
the newest running request is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed (its prefix blocks usually still hit the cache). Under the
priority policy both queues go in order of priority (`WaitingQueue`): the most urgent running
request is scheduled first, the least urgent preempted first.

Async scheduling: a running request with tokens in flight (output not yet taken) goes on from
them, its next input the token in flight (`SAMPLED_IN_FLIGHT`), unless that is its last. One
preempted since keeps that token; one that finishes keeps its blocks until the step has ended
(`free_blocks_after_step`): a KV load into them must not race the step's writes.

With a KV connector (PD), a waiting request may have its prompt's KV elsewhere: it gets its
blocks, waits in WAITING_FOR_REMOTE_KV (outside the batch) until the connector reports the load,
then those tokens count as computed. A finished request whose KV a remote decoder will read keeps
its blocks until the connector reports that it is done with them.

Faults: an exception while handling one request (its connector calls at scheduling, its update
after the step) fails that request alone (`fail_request`: finish reason "error", its blocks and
whatever the connector holds for it freed); `step_request_ids` names the requests of the last
schedule, which the engine core fails when a whole step fails.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.outputs import (
    SAMPLED_IN_FLIGHT,
    EngineCoreOutput,
    HandedOffToken,
    KVConnectorOutput,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from tandem.engine.request import Request, RequestStatus
from tandem.engine.structured_output import GrammarMatcher, follow_sampled, grammar_bitmasks
from tandem.engine.waiting_queue import WaitingQueue, urgency
from tandem.kv.connector.base import KVConnectorScheduler, NoKVConnectorScheduler, RequestView

logger = logging.getLogger(__name__)


def connector_view(request: Request) -> RequestView:
    """What the connector's scheduler side reads of a request."""
    return RequestView(
        request.request_id,
        request.num_prompt_tokens,
        request.kv_transfer_params,
        request.status.value if request.status.is_finished else None,
        request.num_output_tokens,
        request.output_token_ids[0] if request.output_token_ids else None,
        request.stop_reason,
    )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024  # admission limit: the server answers 503 beyond it
    policy: str = "fcfs"  # which waiting request goes first, and which running one is preempted


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.connector = connector or NoKVConnectorScheduler()
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.waiting_for_remote: dict[str, Request] = {}
        self.held_for_remote: set[str] = set()  # finished, blocks kept for a remote reader
        self.freed_after_step: list[str] = []  # finished, blocks kept until the step in flight ends
        self.num_preemptions = 0
        # The last schedule's requests (scheduled, or their load begun), the one it was on if it
        # raised included; and the outputs of requests it failed alone, for the engine core.
        self.step_request_ids: list[str] = []
        self.failed_outputs: list[EngineCoreOutput] = []

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def fail_request(self, request_id: str, error: str) -> EngineCoreOutput:
        """End a request with an error: its blocks and what the connector holds for it go. One
        that has finished already (in a step that failed after) gets its lease ended."""
        request = self.requests.get(request_id)
        if request is None:
            self.connector.release(request_id)
            return EngineCoreOutput(request_id, [], finish_reason="error", error=error)
        output = self._finish(request, RequestStatus.FINISHED_ERROR)
        output.error = error
        return output

    def free_blocks_after_step(self) -> None:
        """The step that was in flight has ended: free the blocks of the requests that finished
        while it ran (the engine core calls this once it has waited for a step)."""
        for request_id in self.freed_after_step:
            self.kv.free(request_id)
        self.freed_after_step = []

    def take_failed_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.failed_outputs = self.failed_outputs, []
        return outputs

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                outputs.append(self._finish(request, RequestStatus.FINISHED_ABORTED))
        return outputs

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_remote)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step could make progress without new input."""
        return bool(self.waiting or self.running or self.waiting_for_remote or self.held_for_remote)

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        self.step_request_ids = []
        if self.waiting.by_priority:  # the most urgent first, the least urgent preempted first
            self.running.sort(key=urgency)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.ends_in_flight:  # its update finishes it
                index += 1
                continue
            self.step_request_ids.append(request.request_id)
            num_ahead = request.num_tokens + request.num_in_flight_samples
            num_new = min(num_ahead - request.num_scheduled_tokens, budget)
            while not self.kv.allocate_slots(request, request.num_in_flight_tokens + num_new):
                victim = self._victim()
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                index += 1

        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            self.step_request_ids.append(request.request_id)
            # prompt logprobs need the whole prompt computed here
            cacheable = request.sampling_params.prompt_logprobs is None
            fresh = request.num_computed_tokens == 0
            hits = self.kv.get_computed_blocks(request) if fresh and cacheable else []
            num_local = request.num_computed_tokens + len(hits) * self.kv.block_size
            try:
                num_external, load_async = self.connector.get_num_new_matched_tokens(
                    connector_view(request), num_local
                )
            except Exception as exc:
                self._fail_alone(request, "the KV connector could not take it", exc)
                continue
            if load_async:
                if not self.kv.allocate_slots(request, num_external, hits):
                    break
                self.waiting.popleft()
                request.num_computed_tokens = num_local
                request.num_cached_tokens = num_local
                try:
                    self.connector.update_state_after_alloc(
                        connector_view(request), self.kv.block_ids(request.request_id), num_external
                    )
                except Exception as exc:
                    self._fail_alone(request, "its KV load could not start", exc)
                    continue
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.waiting_for_remote[request.request_id] = request
                continue
            num_new = min(request.num_tokens - num_local, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING and request.num_computed_tokens == 0:
                request.num_cached_tokens = num_local
            request.num_computed_tokens = num_local
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        rows = [item for item in scheduled if item.sample]
        grammars = [self.requests[item.request_id].grammar for item in rows]
        self._add_grammar_bitmasks(rows, grammars)
        return SchedulerOutput(
            requests=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            kv_connector_metadata=self.connector.build_connector_meta(scheduled),
            # the next step needs these tokens on the host: a grammar (active, or waiting for
            # its start) follows them, penalties count them
            needs_sampled_tokens=grammars.count(None) < len(grammars)
            or any(item.sampling_params.penalizes_history for item in rows),
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        self._follow_sampled(scheduler_output, runner_output)
        for item in scheduler_output.requests:
            request = self.requests.get(item.request_id)
            if request is None:
                continue  # finished while the step ran
            try:
                if request.status == RequestStatus.RUNNING:
                    output = self._update(request, item, runner_output)
                elif request.status == RequestStatus.PREEMPTED and item.sample:
                    # preempted after the step began: it keeps the token, recomputes the rest
                    output = self._take_token(request, runner_output)
                else:
                    continue
            except Exception as exc:
                self._fail_alone(request, "its step's output could not be taken", exc)
                continue
            if output is not None:
                outputs.append(output)
        outputs.extend(self.take_failed_outputs())
        return outputs

    def _update(
        self, request: Request, item: ScheduledRequest, runner_output: RunnerOutput
    ) -> EngineCoreOutput | None:
        """Take one request's part of a step's output; its output, if it has one now."""
        if (prompt_part := runner_output.prompt_logprobs.get(item.request_id)) is not None:
            first, entries = prompt_part
            recorded = len(request.prompt_logprobs) + 1  # prompt tokens 1 .. recorded - 1
            if first <= recorded:  # a recomputed prompt (after preemption) adds nothing
                request.prompt_logprobs.extend(entries[recorded - first :])
        # The step computed the request's tokens in flight: count them, cache their full blocks.
        request.num_computed_tokens += len(item.token_ids)
        request.num_in_flight_tokens -= len(item.token_ids)
        self.kv.cache_computed_blocks(request)
        if not item.sample:
            return None  # a prompt's chunk
        return self._take_token(request, runner_output)

    def _take_token(self, request: Request, runner_output: RunnerOutput) -> EngineCoreOutput:
        """Append the token the step sampled for the request; its output (its end, if the token
        ends it)."""
        request.num_in_flight_samples -= 1
        token_id = runner_output.sampled_token_ids[request.request_id]
        logprobs = runner_output.logprobs.get(request.request_id)
        request.output_token_ids.append(token_id)
        status = request.check_stop()
        if status is None:
            output = EngineCoreOutput(
                request.request_id,
                [token_id],
                [logprobs] if logprobs else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
            )
        else:
            output = self._finish(request, status)
            output.new_token_ids = [token_id]
            output.new_logprobs = [logprobs] if logprobs else None
        wants_prompt = request.sampling_params.prompt_logprobs is not None
        if wants_prompt and request.num_output_tokens == 1:
            output.prompt_logprobs = [None, *request.prompt_logprobs]
        return output

    # -- internals -------------------------------------------------------------------------------

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """The next num_new tokens of the request, from its tokens in flight on; they are in
        flight from here until this step's update."""
        start = request.num_scheduled_tokens
        token_ids = request.token_slice(start, start + num_new)
        if len(token_ids) < num_new:  # the last is the token the step in flight samples
            token_ids.append(SAMPLED_IN_FLIGHT)
        sample = start + num_new == request.num_tokens + request.num_in_flight_samples
        output_index = request.num_output_tokens + request.num_in_flight_samples
        request.num_in_flight_tokens += num_new
        request.num_in_flight_samples += sample
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_ids=list(self.kv.block_ids(request.request_id)),
            sample=sample,
            sampling_params=request.sampling_params,
            output_index=output_index,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )

    def _add_grammar_bitmasks(
        self, rows: list[ScheduledRequest], grammars: list[GrammarMatcher | None]
    ) -> None:
        """The allowed tokens of the structured outputs of the rows that sample in this step
        (`grammars`, theirs), computed here (the matchers stay with the scheduler) and carried
        to the sampler as plain bytes."""
        if grammars.count(None) == len(grammars):  # every step runs this: no generator
            return
        for item, bitmask in zip(rows, grammar_bitmasks(grammars), strict=True):
            item.grammar_bitmask = bitmask

    def _follow_sampled(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> None:
        """Advance the grammars that gave this step a bitmask over the tokens sampled for them,
        before the tokens are taken (a grammar the token completes ends its request)."""
        grammars, token_ids = [], []
        for item in scheduler_output.requests:
            if item.grammar_bitmask is None:  # most rows: no look-ups for them
                continue
            request = self.requests.get(item.request_id)
            token_id = runner_output.sampled_token_ids.get(item.request_id)
            if request is None or token_id is None:
                continue
            grammars.append(request.grammar)
            token_ids.append(token_id)
        follow_sampled(grammars, token_ids)

    def _fail_alone(self, request: Request, what: str, exc: Exception) -> None:
        """An exception pinned on one request fails it alone (its output waits in
        failed_outputs); the traceback goes to the log."""
        logger.error("request %s failed: %s", request.request_id, what, exc_info=exc)
        error = f"the engine failed on this request: {what} ({type(exc).__name__}: {exc})"
        self.failed_outputs.append(self.fail_request(request.request_id, error))

    def _victim(self) -> Request:
        """The running request to preempt for the one being scheduled: the last one, the newest
        (fcfs) or the least urgent (priority), which is that one itself when no other is left to
        schedule in this step."""
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_in_flight_tokens = 0  # their KV is dropped; a token in flight is kept
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> EngineCoreOutput:
        request.status = status
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.waiting_for_remote.pop(request.request_id, None)
        block_ids = self.kv.block_ids(request.request_id)
        delay_free, kv_transfer_params = self.connector.request_finished(
            connector_view(request), block_ids
        )
        if delay_free:
            self.held_for_remote.add(request.request_id)
        elif request.num_in_flight_tokens:
            self.freed_after_step.append(request.request_id)
        else:
            self.kv.free(request.request_id)
        grammar_error = request.grammar.error if request.grammar is not None else None
        return EngineCoreOutput(
            request.request_id,
            [],
            finish_reason=status.value,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            kv_transfer_params=kv_transfer_params,
            error=f"the output left its structured-output grammar: {grammar_error}"
            if grammar_error
            else None,
        )

    def _take_handed_off_token(
        self, request: Request, handed_off: HandedOffToken
    ) -> EngineCoreOutput:
        """A handoff's first token, announced by the prefill: the request's first output, and
        its end if that token ended it there (or ends it here)."""
        request.output_token_ids.append(handed_off.token_id)
        status = request.check_stop()
        if handed_off.finish_reason is not None:
            status = RequestStatus(handed_off.finish_reason)
            request.stop_reason = handed_off.stop_reason
        if status is None:
            return EngineCoreOutput(
                request.request_id,
                [handed_off.token_id],
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
            )
        output = self._finish(request, status)
        output.new_token_ids = [handed_off.token_id]
        return output

    def update_from_connector(
        self, connector_output: KVConnectorOutput | None
    ) -> list[EngineCoreOutput]:
        """Apply the connector's finished transfers (before the step's schedule): loaded
        requests wait to be scheduled, failed ones are recomputed or fail, blocks that remote
        readers are done with are freed."""
        outputs: list[EngineCoreOutput] = []
        if connector_output is None:
            return outputs
        self.connector.update_connector_output(connector_output)
        # Blocks kept for the connector: a lease's once it ended, a load's (its request finished
        # while it ran) once the load ended.
        for request_id in (
            *connector_output.finished_sending,
            *connector_output.finished_recving,
            *connector_output.failed_recving,
        ):
            if request_id in self.held_for_remote:
                self.held_for_remote.discard(request_id)
                self.kv.free(request_id)
        # A handoff's first token comes with its load's report, whatever the load's outcome; a
        # request it ends leaves waiting_for_remote here.
        for request_id, handed_off in connector_output.first_tokens.items():
            request = self.waiting_for_remote.get(request_id)
            if request is not None:
                outputs.append(self._take_handed_off_token(request, handed_off))
        for request_id in connector_output.finished_recving:
            request = self.waiting_for_remote.pop(request_id, None)
            if request is None:
                continue
            request.num_computed_tokens = request.num_tokens - 1
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        for request_id, kind in connector_output.failed_recving.items():
            request = self.waiting_for_remote.get(request_id)
            if request is None:
                continue
            # Recomputing needs the first token the client was sent: a handoff whose prefill
            # never announced one cannot be recomputed without risking a different one.
            params = request.kv_transfer_params
            unannounced = request_id not in connector_output.first_tokens and bool(
                params and params.is_handoff
            )
            if self.connector.recompute_on_failure and not unannounced:
                # Start over as after a preemption: the blocks the load was to fill hold nothing
                # valid, and a retry with prefix hits must get a block table that starts with them.
                del self.waiting_for_remote[request_id]
                self.kv.free(request_id)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)
            else:
                output = self._finish(request, RequestStatus.FINISHED_ERROR)
                output.error = f"the KV transfer from the prefill worker failed ({kind})"
                outputs.append(output)
        return outputs
