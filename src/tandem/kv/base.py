"""The KV connector interface: the hooks through which the engine moves KV to and from elsewhere.

Scheduler side (called by the scheduler, pure bookkeeping):
    get_num_new_matched_tokens(request, num_local) -> (num_external, load_async)
    update_state_after_alloc(request, block_ids, num_external)
    build_connector_meta(scheduled) -> metadata for this step's runner
    request_finished(request, block_ids) -> (delay_free, kv_transfer_params)

Worker side (called by the model runner around the forward pass):
    start_load_kv(metadata)             begin this step's loads (never blocks the batch)
    save_kv_layer(layer_index, kv_cache, metadata)   after each layer's KV is written
    saves_between_layers(metadata) -> bool   whether those saves gain from running between the
                                        layers (else they may all run after the whole pass)
    wait_for_save(metadata)             after the forward pass
    sampled_on_device(metadata, requests, token_ids)   once the step's tokens are sampled on
                                        the device, before the host reads them
    write_device_inputs(metadata, input_ids)   before the forward pass, once its inputs are on
                                        the device: tokens that are only on a device (a
                                        handoff's first token on the prefill's GPU)
    get_finished() -> KVConnectorOutput loads done or failed, remote readers done
    set_wakeup(callback)                called from a transport thread whenever get_finished
                                        has something new, so an idle engine loop wakes at once

`NoKVConnector` is the colocated engine's: it matches nothing and holds nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tandem.engine.outputs import KVConnectorOutput, ScheduledRequest
    from tandem.engine.request import Request


def is_pending_handoff(params: dict[str, Any] | None) -> bool:
    """Decode-side kv_transfer_params of a handoff: the prefill announces its transfer (and
    first token) later, under handoff_id, instead of the params carrying them."""
    params = params or {}
    return bool(params.get("do_remote_prefill") and params.get("handoff_id")) and (
        "first_token_id" not in params
    )


class KVConnector:
    recompute_on_failure: bool = True

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> Any:
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # worker side
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        return None

    def start_load_kv(self, metadata: Any) -> None:
        return None

    def save_kv_layer(self, layer_index: int, metadata: Any) -> None:
        return None

    def saves_between_layers(self, metadata: Any) -> bool:
        """True when this step's save_kv_layer calls have work to overlap with the layers after
        theirs; False lets the runner queue the whole forward pass first (one CUDA graph) and
        make every layer's call after it."""
        return False

    def wait_for_save(self, metadata: Any) -> None:
        return None

    def sampled_on_device(
        self, metadata: Any, requests: Sequence[ScheduledRequest], token_ids: torch.Tensor
    ) -> None:
        return None

    def write_device_inputs(self, metadata: Any, input_ids: torch.Tensor) -> None:
        return None

    def get_finished(self) -> KVConnectorOutput | None:
        return None

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        return None

    # both sides
    def release(self, remote_request_id: str) -> None:
        """Free a leased request's blocks now (the router gave the request up)."""
        return None

    def release_remote(self, kv_transfer_params: dict[str, Any]) -> None:
        """Tell a prefill worker its lease is done without loading it (the request finished
        on its first token here)."""
        return None

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics. "kv_transfer_seconds" (a list) and "kv_transfer_failures"
        (kind -> count: a load's failure kind, "send" for a fetch or hold that broke on the
        prefill side, "retried" for a broken connection tried again) hold only what happened
        since the previous call."""
        return {}

    def shutdown(self) -> None:
        return None


class NoKVConnector(KVConnector):
    """The colocated engine's connector."""
