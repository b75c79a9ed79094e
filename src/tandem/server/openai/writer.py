"""What the completion and chat writers share: a response assembled from the engine's deltas,
either collected into one OpenAI body or streamed as its chunks (`ResponseWriter`), and the
latency metrics of that response.

The deltas come as (prompt index, delta); choice i of a response is sample i % n of prompt
i // n. A delta that ends in an error raises a `ClientError` (collected) or ends the stream with
an error event (streamed). A subclass says what a choice looks like, whole (`full_choice`) and as
a delta (`delta_choice`).

A PD decode leg told `first_token_sent` (docs/protocol.md, "The first token") streams a client
that has the first token already, from the router or the `pd` server: the first token's text
goes into its choice (the parsers see the whole output) but not into the stream, which carries
only what the client's first chunk left out. The engine emits such a first token in a delta of
its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.processor import SequenceDelta
from tandem.kv.params import to_wire
from tandem.pd.text import shown_first_text, stop_hold_back
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.metrics import WorkerMetrics
from tandem.server.openai.protocol import ClientError, SamplingFields, error_body
from tandem.server.settings import ServerSettings

# a running stream counts in the load report's TPOT once it has this many tokens
LIVE_TPOT_TOKENS = 16


@dataclass
class Choice:
    """One output sequence being assembled from deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None  # one entry per prompt token, None for the first
    # streamed chat with tool_choice "auto" or a reasoning parser: characters of the content
    # (the text after the reasoning, if any) and of the reasoning sent
    content_sent: int = 0
    reasoning_sent: int = 0
    # streamed completion with logprobs: the next token's text_offset (its tokens' texts so far)
    text_offset: int = 0
    arguments_sent: list[int] = field(default_factory=list)  # per tool call begun (streamed)

    def take(self, delta: SequenceDelta) -> None:
        """Add what one delta brings."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


class ResponseWriter:
    """Turns delta streams into one OpenAI response (collected) or its chunks (streamed)."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        client: AsyncEngineClient,
        settings: ServerSettings,
        body: SamplingFields,
        response_id: str,
        prompt_ids: list[list[int]],
    ) -> None:
        self.client = client
        self.settings = settings
        self.body = body
        self.response_id = response_id
        self.prompt_ids = prompt_ids
        self.created = int(time.time())
        self.n = body.n
        # a decode leg's one sequence, whose first token the client has (streamed only: a
        # whole answer holds the whole completion)
        self.first_token_sent = (
            body.stream
            and len(prompt_ids) * body.n == 1
            and bool((body.kv_transfer_params or {}).get("first_token_sent"))
        )
        self.hold_back = stop_hold_back(body.stop, body.include_stop_str_in_output)

    def choice_index(self, prompt_index: int, delta: SequenceDelta) -> int:
        return prompt_index * self.n + delta.index

    def usage(self, choices: dict[int, Choice], cached: int) -> dict[str, Any]:
        prompt_tokens = sum(len(ids) for ids in self.prompt_ids)
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def with_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        if self.body.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def token_text(self, token_id: int) -> str:
        tokenizer = self.client.tokenizer
        return "" if tokenizer is None else tokenizer.decode([token_id])

    def with_prompt_logprobs(self, target: dict[str, Any], entries: list | None) -> dict[str, Any]:
        """`target` with vLLM's prompt_logprobs when the request asked for them: per prompt
        token (None for the first) {token id: {logprob, rank, decoded_token}} for the token
        and the top prompt_logprobs."""
        count = self.body.prompt_logprobs
        if count is None or entries is None:
            return target
        listed: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                listed.append(None)
                continue
            item = {
                str(entry.token_id): self.vllm_logprob(entry.token_id, entry.logprob, entry.rank)
            }
            for rank, (token_id, logprob) in enumerate(entry.top[:count], start=1):
                item.setdefault(str(token_id), self.vllm_logprob(token_id, logprob, rank))
            listed.append(item)
        target["prompt_logprobs"] = listed
        return target

    def vllm_logprob(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token_id)}

    def new_choices(self) -> dict[int, Choice]:
        return {index: Choice() for index in range(len(self.prompt_ids) * self.n)}

    async def collect(self, deltas, metrics: WorkerMetrics, arrival: float) -> dict[str, Any]:
        choices = self.new_choices()
        cached = 0
        kv_transfer_params = None
        tracker = LatencyTracker(metrics, self.settings.served_model_name, arrival, len(choices))
        try:
            async for prompt_index, delta in deltas:
                tracker.observe(delta)
                choices[self.choice_index(prompt_index, delta)].take(delta)
                if delta.finish_reason is not None:
                    cached += delta.num_cached_tokens
                    kv_transfer_params = delta.kv_transfer_params or kv_transfer_params
                check_error(delta)
        finally:  # a request cut short (disconnect, error) is counted too
            tracker.finish(choices.values())
        response = {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.settings.served_model_name,
            "choices": [
                self.with_token_ids(self.full_choice(i, choices[i]), choices[i].token_ids)
                for i in sorted(choices)
            ],
            "usage": self.usage(choices, cached),
        }
        if self.body.kv_transfer_params is not None:  # a PD leg's: the lease, as JSON holds it
            response["kv_transfer_params"] = (
                None if kv_transfer_params is None else to_wire(kv_transfer_params)
            )
        return self.with_response_fields(response, choices)

    def with_response_fields(
        self, response: dict[str, Any], choices: dict[int, Choice]
    ) -> dict[str, Any]:
        """What a response holds besides its choices (by endpoint)."""
        return response

    async def stream(
        self, deltas, metrics: WorkerMetrics, arrival: float
    ) -> AsyncIterator[dict[str, Any]]:
        choices = self.new_choices()
        cached = 0
        tracker = LatencyTracker(metrics, self.settings.served_model_name, arrival, len(choices))
        options = self.body.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)

        def with_usage(chunk: dict[str, Any]) -> dict[str, Any]:
            if continuous:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                chunk["usage"] = self.usage(choices, cached)
            return chunk

        try:
            async for event in self.opening_chunks():
                yield with_usage(event)
            async for prompt_index, delta in deltas:
                tracker.observe(delta)
                index = self.choice_index(prompt_index, delta)
                choice = choices[index]
                client_has_it = self.first_token_sent and not choice.token_ids and delta.token_ids
                choice.take(delta)
                if client_has_it:  # the first token: its text is parsed, not sent again
                    delta = self.left_unsent(choice, delta)
                if delta.finish_reason is not None:
                    cached += delta.num_cached_tokens
                if delta.finish_reason == "error":
                    message = delta.error or "the request failed"
                    yield {"error": error_body(message, delta.error_status)["error"]}
                    return
                wants_ids = self.body.return_token_ids and delta.token_ids
                if delta.text or delta.finish_reason is not None or delta.logprobs or wants_ids:
                    choice_chunk = self.delta_choice(index, delta, choice)
                    if choice_chunk is not None:
                        chunk = self.chunk([self.with_token_ids(choice_chunk, delta.token_ids)])
                        yield with_usage(chunk)
        finally:  # a request cut short (disconnect, error) is counted too
            tracker.finish(choices.values())
        if options is not None and options.include_usage:
            yield self.chunk([], usage=self.usage(choices, cached))

    async def opening_chunks(self) -> AsyncIterator[dict[str, Any]]:
        return
        yield

    def left_unsent(self, choice: Choice, delta: SequenceDelta) -> SequenceDelta:
        """The first token's delta less what the client's first chunk holds: its id and
        logprobs, and its whole text less the stop-string hold-back (`pd.text`; all of the
        delta's text unless the delta also ends the output)."""
        first_text = self.first_token_text(delta.token_ids[0])
        self.count_first_chunk(choice, delta.token_ids[0], first_text)
        shown = shown_first_text(first_text, self.hold_back)
        return dataclasses.replace(
            delta, text=delta.text[len(shown) :], token_ids=[], logprobs=None
        )

    def first_token_text(self, token_id: int) -> str:
        """The first token's whole text, as the prefill worker decoded it (after the prompt)."""
        detokenizer = IncrementalDetokenizer(
            self.client.tokenizer, self.prompt_ids[0], self.body.skip_special_tokens
        )
        return detokenizer.add(token_id)

    def count_first_chunk(self, choice: Choice, token_id: int, first_text: str) -> None:
        """Count as sent what the client's first chunk holds of the first token (`token_id`,
        whose text after the prompt is `first_text`)."""

    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        chunk = {
            "id": self.response_id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.settings.served_model_name,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk


def check_error(delta: SequenceDelta) -> None:
    if delta.finish_reason == "error":
        raise ClientError(delta.error or "the request failed", delta.error_status)


class LatencyTracker:
    """Feeds TTFT, inter-token and end-to-end latency of one response into the metrics, and the
    load report's requests in flight; a response of one choice is a live stream of the load
    report until it ends, then its time per output token goes in."""

    def __init__(
        self, metrics: WorkerMetrics, model_name: str, arrival: float, num_choices: int
    ) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.tokens = 0
        self.one_stream = num_choices == 1
        metrics.request_began()
        if self.one_stream:
            metrics.live_streams.add(self)

    def observe(self, delta: SequenceDelta) -> None:
        if not delta.token_ids:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.metrics.ttft.labels(self.model_name).observe(now - self.arrival)
            self.first_token_time = now
        else:
            self.metrics.itl.labels(self.model_name).observe(now - self.last_token_time)
        self.last_token_time = now
        self.tokens += len(delta.token_ids)
        self.metrics.generation_tokens.labels(self.model_name).inc(len(delta.token_ids))

    def tpot_so_far(self, min_tokens: int = LIVE_TPOT_TOKENS) -> float | None:
        """From the first token to the latest over the tokens after the first; None before
        `min_tokens` (the first few gaps say little of a stream)."""
        if self.tokens < max(2, min_tokens):
            return None
        return (self.last_token_time - self.first_token_time) / (self.tokens - 1)

    def finish(self, choices) -> None:
        now = time.monotonic()
        self.metrics.e2e.labels(self.model_name).observe(now - self.arrival)
        self.metrics.request_ended(now)
        if self.one_stream:
            self.metrics.live_streams.discard(self)
            tpot = self.tpot_so_far(min_tokens=2)
            if tpot is not None:
                self.metrics.observe_tpot(now, tpot)
        for choice in choices:
            self.metrics.requests.labels(self.model_name, choice.finish_reason or "abort").inc()
