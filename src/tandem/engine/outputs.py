"""The plain dataclasses the scheduler, the executor and the engine core exchange.

The scheduler never sees a tensor and the executor never sees a `Request`: each step the scheduler
says what to compute (`SchedulerOutput`), the executor says what it sampled (`RunnerOutput`), and
the engine core reports per-request progress to its client (`EngineCoreOutput`).

Invariant: a `SchedulerOutput` is plain data (ids, token ids, positions, block tables, sampling
parameters, structured outputs' allowed-token bitmasks): no `Request`, no grammar state, nothing
live, so it round-trips through msgspec and an executor of several ranks can broadcast it. Its
lists may be the scheduler's own (no copies), which nothing changes while the step runs.

Async scheduling: a step is scheduled while the step before still runs, so a decoding request's
input token may be one that step is sampling, unknown to the host. Such a token is
`SAMPLED_IN_FLIGHT` in `token_ids` (always the last): the runner takes it on the device from the
step before's samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.kv.connector.base import KVTransferParams

SAMPLED_IN_FLIGHT = -1  # a token id: the one the step before samples for this request


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_position: int  # position of token_ids[0] == tokens already in the cache
    block_ids: list[int]  # the request's whole block table
    sample: bool  # this step reaches the request's last token: sample the next one
    sampling_params: SamplingParams
    output_index: int  # index of the token to be sampled among the request's outputs
    # The request's own lists (not copies), read by prompt logprobs and the sampler's penalties.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # The tokens its structured output allows for this step's sample, or None for any token:
    # int32 words in native byte order, token i at bit i % 32 of word i // 32.
    grammar_bitmask: bytes | None = None


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest]
    num_batched_tokens: int
    kv_connector_metadata: Any = None
    # a request of this step samples under a structured output or penalties, whose next step
    # needs the token on the host first: async scheduling takes this step's output before the next
    needs_sampled_tokens: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # of token_id among all tokens (1: the likeliest)


@dataclass(frozen=True)
class HandedOffToken:
    """The first token a remote prefill announced to a decode worker that was already waiting;
    finish_reason is set when that token ended the request on the prefill side."""

    token_id: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class KVConnectorOutput:
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> failure kind
    finished_sending: set[str] = field(default_factory=set)
    first_tokens: dict[str, HandedOffToken] = field(default_factory=dict)  # handoffs only


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> (prompt index of the first entry, logprobs of prompt tokens from there on)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    # With a request's first output, when it asked for them: one entry per prompt token (None
    # for the first, which nothing predicts).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error_status: int = 500  # an error's HTTP status: 400 when the request itself cannot be served

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
