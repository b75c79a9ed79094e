"""The KV connector's two interfaces, built once per side as vLLM's KV connector API does; the
engine imports only this module (and `tandem.kv.connector.make_connectors`).

Scheduler side (`KVConnectorScheduler`, the scheduler's thread; bookkeeping, and the control
plane's engine-wide calls):
    get_num_new_matched_tokens(request, num_local) -> (num_external, load_async)
    update_state_after_alloc(request, block_ids, num_external)
    build_connector_meta(scheduled) -> KVConnectorMetadata for this step's worker side
    update_connector_output(output)     the worker side's report, as the scheduler takes it
    request_finished(request, block_ids) -> (delay_free, KVTransferParams | None)
    release(remote_request_id), release_remote(params), stats(), set_wakeup(callback)
Worker side (`KVConnectorWorker`, around the forward pass, one per rank):
    register_kv_cache(kv_cache); start_load_kv(metadata) (never blocks the batch);
    save_kv_layer(layer_index, metadata) after each layer's KV is written;
    saves_between_layers(metadata); wait_for_save(metadata);
    get_finished() -> KVConnectorOutput | None (loads done or failed, leases ended)

The two sides share only the metadata, the worker side's report and the control plane. The
scheduler hands the scheduler side a `RequestView` (plain values), never its `Request`.
`NoKVConnectorScheduler` / `NoKVConnectorWorker` are a colocated engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.kv.params import (  # the engine's form of kv_transfer_params
    FirstTokenLogprobs,
    KVTransferParams,
)

if TYPE_CHECKING:
    import torch

    from tandem.engine.outputs import KVConnectorOutput, ScheduledRequest
    from tandem.kv.connector.metadata import KVConnectorMetadata

__all__ = [
    "ConnectorFactory",
    "FirstTokenLogprobs",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVTransferParams",
    "NoKVConnectorScheduler",
    "NoKVConnectorWorker",
    "RankKVTransfer",
    "RequestView",
]


@dataclass(frozen=True)
class RequestView:
    """What the scheduler side reads of a request."""

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: KVTransferParams | None
    finish_status: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    num_output_tokens: int = 0
    first_token_id: int | None = None
    stop_reason: int | str | None = None


class KVConnectorScheduler:
    recompute_on_failure: bool = True

    def get_num_new_matched_tokens(self, request: RequestView, num_local: int) -> tuple[int, bool]:
        """How many of the prompt's tokens past num_local come from elsewhere, and whether they
        load asynchronously (the request waits outside the batch meanwhile)."""
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external: int
    ) -> None:
        return None

    def build_connector_meta(
        self, scheduled: Sequence[ScheduledRequest]
    ) -> KVConnectorMetadata | None:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        return None

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """Whether the blocks stay until the worker side reports the request finished sending
        (or its load ended), and the params a remote decode needs."""
        return False, None

    def release(self, remote_request_id: str) -> None:
        """Free a leased request's blocks now (the router gave the request up)."""
        return None

    def release_remote(self, kv_transfer_params: KVTransferParams) -> None:
        """Tell a prefill worker its lease is done without loading it."""
        return None

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        """callback() runs on a transport thread whenever get_finished has news, so an idle
        engine loop wakes at once."""
        return None

    @property
    def kv_port(self) -> int | None:
        """Where this engine's KV server listens (an engine that serves KV)."""
        return None

    @property
    def kv_engine_id(self) -> str | None:
        """This engine's id, which its KV server answers to (an engine that serves KV)."""
        return None

    @property
    def kv_layout(self) -> str | None:
        """The KV layout this engine's transfers carry (an engine with KV transfer)."""
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        return None


class KVConnectorWorker:
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        return None

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        return None

    def save_kv_layer(self, layer_index: int, metadata: KVConnectorMetadata | None) -> None:
        return None

    def saves_between_layers(self, metadata: KVConnectorMetadata | None) -> bool:
        """True when this step's save_kv_layer calls have work to overlap with the layers after
        theirs; False lets the runner queue the whole forward pass first (one CUDA graph) and
        make every layer's call after it."""
        return False

    def wait_for_save(self, metadata: KVConnectorMetadata | None) -> None:
        return None

    def get_finished(self) -> KVConnectorOutput | None:
        return None

    def shutdown(self) -> None:
        return None


class NoKVConnectorScheduler(KVConnectorScheduler):
    """A colocated engine's scheduler side: matches nothing, holds nothing."""


class NoKVConnectorWorker(KVConnectorWorker):
    """A colocated engine's worker side."""


class RankKVTransfer(msgspec.Struct):
    """What a tensor-parallel rank other than 0 needs to build its worker side (rank 0 sends it
    with InitializeKVCache): the engine's KV transport (tcp: the rank's shards move through
    rank 0; a plane that reads in place: the rank registers its cache with a plane of its own),
    the host peers reach it at, and the plane's transfer timeout."""

    transport: str
    host: str
    transfer_timeout_s: float


ConnectorFactory = Callable[[Any, "torch.device"], tuple[KVConnectorScheduler, KVConnectorWorker]]
