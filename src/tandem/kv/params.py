"""kv_transfer_params, the PD fields of a request, parsed and checked once in the worker's API
process, before the request reaches the engine (so before any block is allocated for it).

The fields keep vLLM's names and wire format (docs/protocol.md); a request holds one of three
shapes:

    prefill leg   do_remote_decode [, handoff_id]                this worker serves the KV
    decode leg    do_remote_prefill + the prefill answer's       this worker loads the KV
                  params (first_token_id, remote_block_ids, ...)
    handoff leg   do_remote_prefill + handoff_id, remote_host,   ... once the prefill announces
                  remote_port, kv_transport (no first token)     the rest under handoff_id

`KVTransferParams` checks types and static ranges (`typed`); `check_kv_transfer_params` then
holds them to this worker (role, transport, block size, vocabulary) and to the request's prompt.
The struct is the one form in the API process, the engine and the connector; `to_wire` makes the
JSON-ready dict (nulls left out) where params leave them, in an HTTP answer or a request to
another worker. Unknown keys are ignored (vLLM sends some). Every refusal is a `KVParamsError`
naming the field. A layout the prefill and decode workers do not share (`kv_layout`, the
model's whatever either side's tensor-parallel size) is refused here where the worker knows its
own, else the connector finds it and recomputes or fails the load, as for any transfer that
cannot be used.

`HandedOutLeases` remembers the lease ids (`remote_request_id`) a prefill worker gave out, so
that `POST /v1/kv/release` can answer 404 for any other id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

MAX_ID_LENGTH = 256  # ids, host names and layouts; a CUDA IPC handle may be longer
MAX_HANDLE_LENGTH = 16384
MAX_TP_SIZE = 64

ShortString = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LENGTH)]
HandleString = Annotated[str, Meta(min_length=1, max_length=MAX_HANDLE_LENGTH)]
NonNegative = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
# the fields that reach a source's cache, by transport (a plane that reads it in place)
HANDLE_FIELDS = {
    "cuda-ipc": "kv_ipc_handle",
    "nixl": "kv_memory_handle",
    "mooncake": "kv_memory_handle",
}


class RankExport(msgspec.Struct, frozen=True, omit_defaults=True):
    """One rank of a tensor-parallel prefill whose cache is read in place: the model's KV heads
    [kv_head_start, kv_head_start + num_kv_heads) it holds, and its data plane's export."""

    kv_head_start: NonNegative
    num_kv_heads: Positive
    kv_ipc_handle: HandleString | None = None
    kv_memory_handle: HandleString | None = None


class KVTransferParams(msgspec.Struct, frozen=True):
    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    handoff_id: ShortString | None = None
    remote_engine_id: ShortString | None = None
    remote_request_id: ShortString | None = None
    remote_block_ids: list[NonNegative] | None = None
    remote_host: ShortString | None = None
    remote_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    # the prefill engine's tensor-parallel size; its kv_layout is the model's (every KV head),
    # whatever the size, so a decode of any size pairs with it (docs/protocol.md)
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP_SIZE)] | None = None
    kv_transport: ShortString | None = None
    first_token_id: NonNegative | None = None
    num_prompt_tokens: Positive | None = None
    block_size: Positive | None = None
    kv_layout: ShortString | None = None
    kv_ipc_handle: HandleString | None = None
    # tandem's own: where nixl and mooncake read the prefill's cache (kv/data/registered.py)
    kv_memory_handle: HandleString | None = None
    # tandem's own: a tensor-parallel prefill's ranks, one each, for the planes that read in
    # place (each decode rank reads its heads from the ranks holding them); the handle fields
    # above are then left out
    kv_rank_exports: (
        Annotated[list[RankExport], Meta(min_length=1, max_length=MAX_TP_SIZE)] | None
    ) = None
    # tandem's own (no vLLM name): the client has the first token already, from the prefill's
    # answer, so the decode leg's stream starts after it (docs/protocol.md, "The first token")
    first_token_sent: bool | None = None
    first_token_logprobs: FirstTokenLogprobs | None = None  # tandem's own, see its struct

    @property
    def is_handoff(self) -> bool:
        """A decode leg whose prefill announces its transfer later, under handoff_id."""
        return bool(self.do_remote_prefill and self.handoff_id) and self.first_token_id is None


# What a decode leg in vLLM's flow needs from the prefill answer; a handoff leg gets it from the
# announcement. cuda-ipc also needs kv_ipc_handle; nixl and mooncake kv_memory_handle (or, from a
# tensor-parallel prefill, kv_rank_exports that carry them).
DECODE_FIELDS = (
    "first_token_id",
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "num_prompt_tokens",
    "block_size",
)
HANDOFF_FIELDS = ("remote_host", "remote_port", "kv_transport")


class FirstTokenLogprobs(msgspec.Struct, frozen=True, omit_defaults=True):
    """The prefill's first token's logprob, its rank and the top alternatives (token id,
    logprob; best first), in a lease when the request asked for logprobs: tandem's own, so that
    a decode leg's answer holds every token's (docs/protocol.md, "The first token")."""

    logprob: float
    top: list[tuple[NonNegative, float]] = msgspec.field(default_factory=list)
    rank: Positive | None = None


class KVParamsError(ValueError):
    """A kv_transfer_params field this worker cannot take; `param` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kv_transfer_params.{field}: {message}")
        self.param = "kv_transfer_params" + (f".{field.partition('[')[0]}" if field else "")


@dataclass(frozen=True)
class WorkerKV:
    """What the params are held to: this worker's side of the transfer."""

    role: str | None  # prefill | decode | both; None: no KV transport (no PD fields taken)
    transport: str | None
    block_size: int
    vocab_size: int
    kv_layout: str | None = None  # this worker's transfers' layout (None: not held to it)


def check_kv_transfer_params(
    params: KVTransferParams, worker: WorkerKV, num_prompt_tokens: int
) -> None:
    """KVParamsError unless typed params fit this worker and a prompt of `num_prompt_tokens`
    tokens (params made in this process, as the `pd` server's legs, are held to it too)."""
    check_shape(params, worker)
    check_against(params, worker, num_prompt_tokens)


def to_wire(params: KVTransferParams) -> dict[str, Any]:
    """The params as JSON holds them: the fields given, nulls left out."""
    return {
        name: msgspec.to_builtins(value)
        for name, value in msgspec.structs.asdict(params).items()
        if value is not None
    }


def typed(raw: dict[str, Any]) -> KVTransferParams:
    try:
        return msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).rpartition(" - at `$")
        if not message:  # not a field's error
            raise KVParamsError("", str(exc)) from None
        field = where.removeprefix(".").removesuffix("`")
        raise KVParamsError(field, message[0].lower() + message[1:]) from None


def check_shape(params: KVTransferParams, worker: WorkerKV) -> None:
    """The leg the params make fits this worker, and holds what that leg needs."""
    if params.do_remote_decode and params.do_remote_prefill:
        message = "a prefill leg (do_remote_decode) or a decode leg, not both: drop one"
        raise KVParamsError("do_remote_prefill", message)
    leg = "do_remote_decode" if params.do_remote_decode else "do_remote_prefill"
    if (params.do_remote_decode or params.do_remote_prefill) and worker.role is None:
        message = "this worker has no KV transport (start it with --role prefill or decode)"
        raise KVParamsError(leg, message)
    if params.do_remote_decode and worker.role not in ("prefill", "both"):
        message = f"a {worker.role} worker serves no KV; send the prefill leg to a prefill worker"
        raise KVParamsError(leg, message)
    if params.first_token_sent and not params.do_remote_prefill:
        message = "only a decode leg (do_remote_prefill) streams after a first token: drop it"
        raise KVParamsError("first_token_sent", message)
    if not params.do_remote_prefill:
        return
    if worker.role not in ("decode", "both"):
        message = f"a {worker.role} worker loads no KV; send the decode leg to a decode worker"
        raise KVParamsError(leg, message)
    needed = list(HANDOFF_FIELDS)
    if not params.is_handoff:
        needed += DECODE_FIELDS
        if worker.transport in HANDLE_FIELDS and params.kv_rank_exports is None:
            needed.append(HANDLE_FIELDS[worker.transport])
    for field in needed:
        if getattr(params, field) is None:
            message = "a decode leg needs it: pass on the prefill answer's kv_transfer_params"
            if field == "first_token_id":
                message = (
                    "a decode leg needs the prefill's first token, or a handoff_id to wait for"
                )
            raise KVParamsError(field, message)


def check_against(params: KVTransferParams, worker: WorkerKV, num_prompt_tokens: int) -> None:
    """The values this worker and this prompt fix, wherever they are given."""
    if params.kv_transport is not None and params.kv_transport != worker.transport:
        message = f"{params.kv_transport!r}, but this worker's transport is {worker.transport!r}"
        raise KVParamsError("kv_transport", message)
    if params.first_token_id is not None and params.first_token_id >= worker.vocab_size:
        message = f"{params.first_token_id} is outside the vocabulary [0, {worker.vocab_size})"
        raise KVParamsError("first_token_id", message)
    logprobs = params.first_token_logprobs
    if logprobs is not None and any(token_id >= worker.vocab_size for token_id, _ in logprobs.top):
        message = f"a top token id is outside the vocabulary [0, {worker.vocab_size})"
        raise KVParamsError("first_token_logprobs", message)
    if params.num_prompt_tokens is not None and params.num_prompt_tokens != num_prompt_tokens:
        message = (
            f"{params.num_prompt_tokens}, but the prompt has {num_prompt_tokens} tokens here (do "
            "both workers serve the same model?)"
        )
        raise KVParamsError("num_prompt_tokens", message)
    if params.block_size is not None and params.block_size != worker.block_size:
        message = (
            f"{params.block_size}, but this worker's blocks hold {worker.block_size} tokens "
            "(start both workers with the same --block-size)"
        )
        raise KVParamsError("block_size", message)
    if params.kv_layout is not None and worker.kv_layout not in (None, params.kv_layout):
        message = (
            f"{params.kv_layout!r}, but this worker's KV layout is {worker.kv_layout!r} (layers x "
            "2 x KV heads x head size: dtype): both workers must serve the same model with the "
            "same --dtype"
        )
        raise KVParamsError("kv_layout", message)
    check_rank_exports(params, worker)
    num_blocks = -(-num_prompt_tokens // worker.block_size)
    if params.remote_block_ids is not None and len(params.remote_block_ids) != num_blocks:
        message = (
            f"{len(params.remote_block_ids)} block ids, but a prompt of {num_prompt_tokens} tokens "
            f"fills {num_blocks} blocks of {worker.block_size}"
        )
        raise KVParamsError("remote_block_ids", message)


def check_rank_exports(params: KVTransferParams, worker: WorkerKV) -> None:
    """A tensor-parallel prefill's ranks: one export per rank, each carrying the handle this
    worker's transport reads with (their head ranges are held to the layout at the load)."""
    exports = params.kv_rank_exports
    if exports is None:
        return
    if len(exports) != (params.tp_size or 1):
        message = f"{len(exports)} ranks, but tp_size is {params.tp_size or 1}"
        raise KVParamsError("kv_rank_exports", message)
    field = HANDLE_FIELDS.get(worker.transport or "")
    if field is None:
        message = f"the {worker.transport} transport does not read a prefill's ranks in place"
        raise KVParamsError("kv_rank_exports", message)
    for rank, export in enumerate(exports):
        if getattr(export, field) is None:
            message = "a rank's export needs it: pass on the prefill answer's kv_transfer_params"
            raise KVParamsError(f"kv_rank_exports[{rank}].{field}", message)


class HandedOutLeases:
    """The lease ids (remote_request_id) of the prefill answers a worker gave out, each until
    its lease's timeout has passed or it is released. Every lease lasts as long, so the oldest
    ids end first."""

    def __init__(self, lease_timeout_s: float) -> None:
        self.lease_timeout_s = lease_timeout_s
        self.deadlines: dict[str, float] = {}  # in the order handed out

    def add(self, remote_request_id: str) -> None:
        self._forget_expired()
        self.deadlines[remote_request_id] = time.monotonic() + self.lease_timeout_s

    def pop(self, remote_request_id: str) -> bool:
        """Forget the id; whether it was a live one."""
        self._forget_expired()
        return self.deadlines.pop(remote_request_id, None) is not None

    def _forget_expired(self) -> None:
        now = time.monotonic()
        while self.deadlines:
            oldest, deadline = next(iter(self.deadlines.items()))
            if deadline > now:
                return
            del self.deadlines[oldest]
