"""The one message from the connector's scheduler side to its worker side, once per step (it
rides in `SchedulerOutput.kv_connector_metadata`): plain data, so a multi-rank executor can send
it on with the rest of the step."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tandem.kv.params import KVTransferParams

Spec = TypeVar("Spec")  # a spec with a request_id: InstallSpec, RankReadSpec
Kept = TypeVar("Kept")


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
class InstallSpec:
    """Tensor parallelism: rank 0 has read a request's blocks; every rank writes its KV heads
    of them into block_ids (the load's local_block_ids) before this step."""

    request_id: str
    block_ids: list[int]


@dataclass
class RankReadSpec:
    """Tensor parallelism over a plane that reads in place: rank 0 holds the prefill's lease;
    every rank reads its KV heads of the blocks from the prefill ranks that hold them
    (kv/connector/rank_reads.py)."""

    request_id: str
    remote: KVTransferParams  # the prefill's params (its ranks' exports, its blocks)
    local_block_ids: list[int]
    first_block: int


@dataclass
class KVConnectorMetadata:
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # requests that finished while their load ran: a handoff's wait for its prefill ends, and a
    # read not yet begun is not begun (their blocks stay until the load's report)
    abandoned: list[str] = field(default_factory=list)
    installs: list[InstallSpec] = field(default_factory=list)
    reads: list[RankReadSpec] = field(default_factory=list)


@dataclass
class TransferShape:
    """What this engine's transfers look like on the wire: the model's KV layout (every KV
    head, whatever the tensor-parallel size) and the engine's tensor-parallel size. Both
    connector sides share it; a tensor-parallel executor sets it before the first step."""

    kv_layout: str
    tp_size: int = 1


def kv_layout(kv_spec, num_kv_heads: int | None = None) -> str:
    """The layout both workers of a transfer must share, as kv_transfer_params' kv_layout
    (num_kv_heads: the model's, where the spec is one rank's shard); a latent cache (MLA) is
    "{layers}xlatent{kv_lora_rank}+{qk_rope_head_dim}:{dtype}"."""
    dtype = str(kv_spec.dtype).removeprefix("torch.")
    if kv_spec.latent is not None:
        return f"{kv_spec.num_layers}xlatent{kv_spec.latent[0]}+{kv_spec.latent[1]}:{dtype}"
    heads = kv_spec.num_kv_heads if num_kv_heads is None else num_kv_heads
    return f"{kv_spec.num_layers}x2x{heads}x{kv_spec.head_dim}:{dtype}"


class ForNextStep(Generic[Spec, Kept]):
    """What rank 0 of a tensor-parallel engine hands every rank through the next step's
    metadata (relayed installs, per-rank reads): a load thread adds a spec with what rank 0
    keeps for it, the scheduler side lists the specs added since (`take_ready`), and rank 0's
    worker side takes back what it kept for a request in that step (`take_kept`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready: list[Spec] = []
        self.kept: dict[str, Kept] = {}

    def add(self, spec: Spec, kept: Kept) -> None:
        with self.lock:
            self.ready.append(spec)
            self.kept[spec.request_id] = kept

    def take_ready(self) -> list[Spec]:
        with self.lock:
            ready, self.ready = self.ready, []
        return ready

    def take_kept(self, request_id: str) -> Kept:
        with self.lock:
            return self.kept.pop(request_id)
