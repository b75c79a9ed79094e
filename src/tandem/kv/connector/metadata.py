"""The one message from the connector's scheduler side to its worker side, once per step (it
rides in `SchedulerOutput.kv_connector_metadata`): plain data, so a multi-rank executor can send
it on with the rest of the step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.kv.params import KVTransferParams


@dataclass
class SaveSpec:
    """Stage a request's prompt blocks as this step computes them (its last prompt chunk)."""

    request_id: str
    block_ids: list[int]  # the prompt's blocks


@dataclass
class LoadSpec:
    """Load a request's prompt KV from the prefill worker its params name."""

    request_id: str
    remote: KVTransferParams  # the prefill's params (a handoff's: its id and address)
    local_block_ids: list[int]  # receive remote blocks first_block .. of the prompt
    first_block: int  # local prefix-cache hits cover the blocks before it
    num_prompt_tokens: int


@dataclass
class KVConnectorMetadata:
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # requests that finished while their load ran: a handoff's wait for its prefill ends, and a
    # read not yet begun is not begun (their blocks stay until the load's report)
    abandoned: list[str] = field(default_factory=list)


def kv_layout(kv_spec) -> str:
    """The layout both workers of a transfer must share, as kv_transfer_params' kv_layout."""
    dtype = str(kv_spec.dtype).removeprefix("torch.")
    return f"{kv_spec.num_layers}x2x{kv_spec.num_kv_heads}x{kv_spec.head_dim}:{dtype}"
