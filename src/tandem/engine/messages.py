"""The messages between a worker's API process and its engine core process, as typed structs.

    API process --EngineInput-->  engine core: AddRequests | AbortRequests | ReleaseLease
                                               | ReleaseRemote | SetTokenizer | Shutdown
                <--EngineOutput-- engine core: Ready | StartFailed | Outputs | Fatal

Each message is a msgspec Struct tagged with its kind and travels as msgpack (`encode`,
`INPUT_DECODER`, `OUTPUT_DECODER`), never pickled: a message holds data only, and its decoder
checks every field's type. A request crosses as a `NewRequest` (its ids and settings); the engine
builds its live state (`Request`, and the grammar matcher of a structured output) from it. A
structured output crosses with the grammar the front end compiled and checked, so the engine
never compiles one in its step loop.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kv.connector.base import KVTransferParams


class EngineInfo(msgspec.Struct, frozen=True):
    """What the front end needs to know about the engine it talks to."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    kv_port: int | None = None  # where the KV server listens (workers that serve their KV)
    kv_engine_id: str | None = None  # which engine that KV server answers for
    kv_layout: str | None = None  # what its transfers carry (workers with a KV transport)


class NewRequest(msgspec.Struct):
    """A request as it enters the engine: its prompt, its settings, and the tokens it already
    has (a remotely prefilled request's first token)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int
    arrival_time: float
    kv_transfer_params: KVTransferParams | None = None
    output_token_ids: list[int] = []

    @classmethod
    def of(cls, request: Request) -> NewRequest:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_ids,
            request.max_total_tokens,
            request.arrival_time,
            request.kv_transfer_params,
            request.output_token_ids,
        )

    def to_request(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=self.max_total_tokens,
            arrival_time=self.arrival_time,
            kv_transfer_params=self.kv_transfer_params,
            output_token_ids=self.output_token_ids,
        )


# -- API process -> engine core ------------------------------------------------------------------


class AddRequests(msgspec.Struct, tag="add"):
    requests: list[NewRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class ReleaseLease(msgspec.Struct, tag="release_lease"):
    """A prefill worker's lease released on the router's word (`POST /v1/kv/release`)."""

    remote_request_id: str


class ReleaseRemote(msgspec.Struct, tag="release_remote"):
    """A decode worker will not load this lease (its request needs none): free it remotely."""

    kv_transfer_params: KVTransferParams


class SetTokenizer(msgspec.Struct, tag="tokenizer"):
    """The tokenizer as the tokenizers library's JSON, which structured outputs need."""

    tokenizer_json: str
    eos_token_ids: list[int]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = AddRequests | AbortRequests | ReleaseLease | ReleaseRemote | SetTokenizer | Shutdown


# -- engine core -> API process ------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo


class StartFailed(msgspec.Struct, tag="start_failed"):
    message: str  # why, in a sentence


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: dict[str, Any]  # the engine's gauges and counters (see collect_stats)


class Fatal(msgspec.Struct, tag="fatal"):
    """The engine's last words before it exits: why, and its failed step's outputs."""

    reason: str
    outputs: list[EngineCoreOutput]


EngineOutput = Ready | StartFailed | Outputs | Fatal

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
INPUT_DECODER = msgspec.msgpack.Decoder(EngineInput)
OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineOutput)
