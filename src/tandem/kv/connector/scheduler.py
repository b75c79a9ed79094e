"""The PD connector's scheduler side: which requests load or serve KV, each step's metadata for
the worker side, and what a finished request leaves behind.

Prefill side (do_remote_decode): the step that computes the prompt's last chunk gets a SaveSpec
(the worker side stages and publishes the transfer, opening its lease); the finished request
keeps its blocks while the lease lives, its params go out in its answer, and a handoff's are
announced under its handoff_id at once, through the control plane (an idle engine may run no
further step); a request that ends without its KV announces its first token or why it gave up.
Decode side (do_remote_prefill): the prompt's tokens not in the local prefix cache load
asynchronously; a failed load is not tried again (the scheduler recomputes or fails it). A
request that finishes while its load runs keeps its blocks until the load's report, and its
worker side is told in the next metadata (`abandoned`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.kv.config import KVTransferConfig
from tandem.kv.connector.base import KVConnectorScheduler, RequestView
from tandem.kv.connector.metadata import (
    ForNextStep,
    KVConnectorMetadata,
    LoadSpec,
    SaveSpec,
    TransferShape,
)
from tandem.kv.control.plane import ControlPlane
from tandem.kv.params import KVTransferParams, to_wire

if TYPE_CHECKING:
    from tandem.engine.outputs import KVConnectorOutput, ScheduledRequest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PDConnectorScheduler(KVConnectorScheduler):
    def __init__(
        self,
        config: KVTransferConfig,
        kv_spec,
        control: ControlPlane,
        shape: TransferShape,
        installs: ForNextStep,
        reads: ForNextStep,
    ) -> None:
        self.config = config
        self.recompute_on_failure = config.load_failure_policy == "recompute"
        self.block_size = kv_spec.block_size
        self.shape = shape
        self.installs = installs
        self.reads = reads
        self.control = control
        self.remote_decode: set[str] = set()  # prefill side: running requests that serve KV
        self.load_attempted: set[str] = set()
        self.new_loads: list[LoadSpec] = []
        self.loading: set[str] = set()  # loads handed to the worker side, not yet reported
        self.abandoned: list[str] = []

    def get_num_new_matched_tokens(self, request: RequestView, num_local: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params is None:
            return 0, False
        if params.do_remote_decode and self.control.server is not None:
            self.remote_decode.add(request.request_id)
            return 0, False
        if (
            params.do_remote_prefill
            and self.control.client is not None
            and request.request_id not in self.load_attempted
        ):
            # Load even when the local prefix cache holds the whole prompt (nothing to read):
            # the load is the confirmation that frees the prefill worker's lease.
            return max(request.num_prompt_tokens - num_local, 0), True
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external: int
    ) -> None:
        self.load_attempted.add(request.request_id)  # only now: a failed allocation retries
        num_prompt_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        first_block = (request.num_prompt_tokens - num_external) // self.block_size
        self.new_loads.append(
            LoadSpec(
                request.request_id,
                request.kv_transfer_params,
                block_ids[first_block:num_prompt_blocks],
                first_block,
                request.num_prompt_tokens,
            )
        )

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> KVConnectorMetadata:
        saves = [
            SaveSpec(
                item.request_id,
                item.block_ids[: cdiv(item.start_position + len(item.token_ids), self.block_size)],
            )
            for item in scheduled
            if item.sample and item.output_index == 0 and item.request_id in self.remote_decode
        ]
        loads, self.new_loads = self.new_loads, []
        self.loading.update(spec.request_id for spec in loads)
        abandoned, self.abandoned = self.abandoned, []
        installs, reads = self.installs.take_ready(), self.reads.take_ready()
        return KVConnectorMetadata(saves, loads, abandoned, installs, reads)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.loading.difference_update(output.finished_recving)
        self.loading.difference_update(output.failed_recving)

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        request_id = request.request_id
        self.load_attempted.discard(request_id)
        if request_id in self.loading:  # the worker side still writes into these blocks
            self.abandoned.append(request_id)
            return True, None
        if request_id not in self.remote_decode:
            self._announce_no_transfer(request)
            return False, None
        self.remote_decode.discard(request_id)
        ended_on_length = request.finish_status == "length" and request.num_output_tokens == 1
        lease = self.control.make_transferable(request_id) if ended_on_length else None
        if lease is None:
            self.control.end_lease(request_id, report=False)
            self._announce_no_transfer(request)
            return False, None
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        params = KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.config.engine_id,
            remote_request_id=request_id,
            remote_block_ids=block_ids[:num_blocks],
            remote_host=self.config.host,
            remote_port=self.control.port,
            tp_size=self.shape.tp_size,
            kv_transport=self.config.transport,
            num_prompt_tokens=request.num_prompt_tokens,
            block_size=self.block_size,
            kv_layout=self.shape.kv_layout,
            first_token_id=request.first_token_id,
            **lease.exported,
        )
        if (handoff_id := self._handoff_id(request)) is not None:
            self.control.announce(handoff_id, to_wire(params), transfer_id=request_id)
        return True, params

    def _handoff_id(self, request: RequestView) -> str | None:
        """Prefill side: the id a decode worker waits on for this request, if one does."""
        params = request.kv_transfer_params
        if self.control.server is None or params is None or not params.do_remote_decode:
            return None
        return params.handoff_id

    def _announce_no_transfer(self, request: RequestView) -> None:
        """A prefill that ends without KV to hand off: its first token if that token ended the
        request, or why it gave up."""
        handoff_id = self._handoff_id(request)
        if handoff_id is None:
            return
        if request.finish_status == "stop" and request.num_output_tokens == 1:
            message = {
                "first_token_id": request.first_token_id,
                "finish_reason": "stop",
                "stop_reason": request.stop_reason,
            }
        else:
            message = {"error": f"the prefill ended without its KV ({request.finish_status})"}
        self.control.announce(handoff_id, message)

    def release(self, remote_request_id: str) -> None:
        if remote_request_id not in self.remote_decode:
            self.control.end_lease(remote_request_id, report=True)

    def release_remote(self, kv_transfer_params: KVTransferParams) -> None:
        self.control.release_remote(kv_transfer_params)

    def set_wakeup(self, callback) -> None:
        self.control.set_wakeup(callback)

    @property
    def kv_port(self) -> int | None:
        return self.control.port

    @property
    def kv_engine_id(self) -> str | None:
        return self.config.engine_id if self.control.server is not None else None

    @property
    def kv_layout(self) -> str | None:
        return self.shape.kv_layout

    def stats(self) -> dict:
        return self.control.stats()

    def shutdown(self) -> None:
        self.control.close()
