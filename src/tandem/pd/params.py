"""The PD fields each leg of a handoff carries, as typed `KVTransferParams` (kv/params.py);
`to_wire` (kv/params.py) and `from_wire` are where they become or stop being JSON-ready dicts.

The prefill leg keeps vLLM's shape (its remote_* keys null), so vLLM's own prefill workers take
it; every field is documented in docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.kv.params import KVTransferParams, to_wire

# What vLLM's proxy sends a prefill worker besides do_remote_decode/do_remote_prefill: nulls.
VLLM_PREFILL_NULLS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")


def from_wire(raw: Any) -> KVTransferParams:
    """A worker's kv_transfer_params, typed; msgspec.ValidationError if they are malformed.
    Keys tandem does not know are dropped (vLLM adds some)."""
    return msgspec.convert(raw, KVTransferParams)


def prefill_params(handoff_id: str | None = None) -> KVTransferParams:
    """A prefill leg's kv_transfer_params (with `handoff_id`: a handoff's)."""
    return KVTransferParams(do_remote_decode=True, do_remote_prefill=False, handoff_id=handoff_id)


def prefill_kv_params(handoff_id: str | None = None) -> dict[str, Any]:
    """A prefill leg's kv_transfer_params on the wire, in vLLM's shape."""
    return dict.fromkeys(VLLM_PREFILL_NULLS) | to_wire(prefill_params(handoff_id))


def handoff_decode_params(
    handoff_id: str,
    host: str | None,
    port: int | None,
    transport: str | None,
    engine_id: str | None = None,
) -> KVTransferParams:
    """A decode leg that goes out with the prefill leg and waits on the prefill worker's KV
    server (`host`:`port`, over `transport`) for the announcement of `handoff_id`; when
    `engine_id` is known, only that engine's server may answer (not one restarted there)."""
    return KVTransferParams(
        do_remote_prefill=True,
        do_remote_decode=False,
        handoff_id=handoff_id,
        remote_engine_id=engine_id,
        remote_host=host,
        remote_port=port,
        kv_transport=transport,
        first_token_sent=True,
    )


def sequential_decode_params(lease: KVTransferParams, first_token_sent: bool) -> KVTransferParams:
    """A decode leg sent once the prefill answered: the prefill's `lease` passed on, marked when
    the client has the first token already."""
    return msgspec.structs.replace(lease, first_token_sent=first_token_sent or None)
