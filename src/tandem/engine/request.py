"""A request as the engine core sees it: token ids in, token ids out, and where it stands.

Phase-free bookkeeping: `num_computed_tokens` counts the tokens whose KV is in the cache (from
the prefix cache, from a remote prefill, or computed here). The scheduler only ever asks how many
of `all_token_ids` are not computed yet; prefill, chunked prefill and decode are the same thing.
A step's tokens count once its output is taken; until then they are in flight
(`num_in_flight_tokens`, and `num_in_flight_samples` tokens being sampled): nonzero between a
schedule and its update, which under async scheduling the next schedule comes between.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.engine.outputs import TokenLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import GrammarMatcher
from tandem.kv.connector.base import KVTransferParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int = 1 << 30  # context length limit of the model
    arrival_time: float = field(default_factory=time.monotonic)
    # PD: the prefill side's kv_transfer_params (decode side) or our own request for remote
    # decode (prefill side); the connector reads them.
    kv_transfer_params: KVTransferParams | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0  # scheduled in a step whose output is not taken yet
    num_in_flight_samples: int = 0  # how many such steps sample a token for it
    num_cached_tokens: int = 0  # prefix-cache hits at first scheduling (for metrics)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Logprobs of prompt tokens 1, 2, ... as their chunks are computed (prompt_logprobs asked).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list, repr=False)
    # The engine's state of the request's structured output (set where the engine takes it).
    grammar: GrammarMatcher | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Computed or in flight: where the next step's tokens start."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def ends_in_flight(self) -> bool:
        """The token a step in flight samples is the request's last by its length limits."""
        outputs = self.num_output_tokens + self.num_in_flight_samples
        return self.num_in_flight_samples > 0 and outputs >= self.max_output_tokens

    @property
    def max_output_tokens(self) -> int:
        room = self.max_total_tokens - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def check_stop(self) -> RequestStatus | None:
        """After a new token: the finished status it causes, or None to go on."""
        params = self.sampling_params
        token_id = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None:
            self.grammar.follow()
            if self.grammar.error is not None:
                return RequestStatus.FINISHED_ERROR
            if self.grammar.is_complete:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
