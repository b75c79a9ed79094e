"""The PD connector: all KV-transfer bookkeeping, once, for every transport.

Prefill side (a request with kv_transfer_params.do_remote_decode):

    step that computes the prompt's last chunk
      save_kv_layer(i): gather the request's blocks of layer i into staging (device -> host)
                        and publish the transfer (decode may fetch layer i once it is copied)
    request_finished (first token sampled, finish "length"):
      keep the blocks under a lease, answer with kv_transfer_params
    transport reports the decode's confirmation, or the lease expires, or release():
      withdraw the transfer, report the request in finished_sending -> the scheduler frees blocks
    finish "stop" on the first token (EOS, stop token): withdraw, free at once, no params

Decode side (a request with kv_transfer_params.do_remote_prefill, carrying the first token):

    get_num_new_matched_tokens: the prompt's tokens not in the local prefix cache, load async
    update_state_after_alloc:   remember which local blocks receive which remote blocks
    start_load_kv:              fetch in a background thread; each arriving layer is scattered
                                into the local blocks (host -> device)
    get_finished:               finished_recving / failed_recving -> the scheduler treats the
                                prompt as computed, or recomputes it / fails the request (policy)
    an aborted request whose load is still running keeps its blocks until the load ends
    a prompt the local prefix cache holds whole, or a request done on its first token, only
    releases the prefill's lease (a transfer confirmed without its bytes)

Handoff (tandem's own, for a router that starts both legs at once): the prefill leg's params carry
a router-chosen `handoff_id`, and the decode leg arrives at the same time with only that id and
the prefill's KV server address. The decode worker allocates the prompt's blocks and its load
thread waits on the prefill's server (`await_announcement`); when the prefill finishes, this
connector announces its kv_transfer_params (or the first token that ended the request, or why it
gave up) under the id, and the load goes on as above. The first token reaches the decode
scheduler with the load's report (`KVConnectorOutput.first_tokens`). A decode request aborted
while it waits cancels the wait.

With the cuda-ipc transport nothing is staged: decode maps the prefill's cache once and copies
the blocks GPU to GPU (`kv/cuda_ipc.py`); the TCP connection carries only a hold on the lease
and, once the copy is done, the confirmation. A handoff's announcement comes with the lease
held; otherwise the load thread asks for the hold and waits for it (a lease that ended first
fails the load). A held lease neither expires nor is released until its decode worker confirms
or its connection drops. With the hold in, the load thread hands the copy to the engine thread,
which queues it at the start of its next step, ahead of that step's kernels on the same GPU
stream order, and schedules the request in that step: no thread waits for the copy on the way
to the first decode step. A confirmation thread waits for the copy's end, records the
transfer's time and confirms.

Early handoffs (cuda-ipc): a decode worker that waits already when the prefill has queued its
whole pass on the GPU gets an early announcement then, ahead of the first token: the blocks, a
CUDA IPC event recorded after the last layer, and a slot of the prefill worker's first-token
buffer (on its GPU, mapped by the decode worker like the cache). Its engine thread queues the
block copy behind that event at once, so the copy's host work overlaps the prefill's last
layers and sampling. Once the first token's sampling is queued too, the sampled token is copied
into the slot and a second IPC event recorded after it, which a further early announcement
names (slot and events are one of a few sets the prefill worker makes at start; a set is its
lease's until that ends, and a prefill with none free announces the handoff only when it is
done). The announcement proper (first token, or why the prefill gave up) follows on the same
connection, and only with it is the load reported. The decode stream's work waits for the copy
from then on, not before (the copy waits for another process's GPU work), with one exception:
once the token's event is known, an idle decode engine may run the request's first decode step
ahead of the announcement proper (`first_tokens_on_device`, see the scheduler), its input token
read from the prefill's slot on the GPU behind the copy and that event (`write_device_inputs`),
and the confirmation waits for that read: the step then starts as the prefill's GPU is done, not
after the first token's round trip through both hosts. A prefill that gives up after an early
announcement keeps its blocks until the decode worker lets go of them; a launched copy is always
confirmed once done.

Blocks of remote and local caches line up one to one: remote block k holds prompt tokens
[k * block_size, (k + 1) * block_size), the same tokens as local block k of the request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.engine.kv_cache_manager import cdiv
from tandem.engine.outputs import HandedOffToken, KVConnectorOutput, ScheduledRequest
from tandem.engine.request import Request, RequestStatus
from tandem.kv.base import KVConnector, is_pending_handoff
from tandem.kv.config import KVTransferConfig
from tandem.kv.transport import KVTransferError, TransferHold, TransportFault

logger = logging.getLogger(__name__)

LOAD_THREADS = 4
EARLY_SLOTS = 32  # cuda-ipc prefill: IPC events and token slots of early announcements
# GPU-direct confirmations get threads of their own: on the load threads they could queue behind
# handoffs that wait for prefills, which may themselves wait for the blocks those confirmations
# free.
CONFIRM_THREADS = 4


@dataclass
class SaveSpec:
    request_id: str
    block_ids: list[int]  # the prompt's blocks


@dataclass
class LoadSpec:
    request_id: str
    remote: dict[str, Any]  # the prefill's kv_transfer_params (a handoff: its id and address)
    local_block_ids: list[int]  # receive remote blocks first_block .. of the prompt
    first_block: int  # local prefix-cache hits cover the blocks before it
    num_prompt_tokens: int


@dataclass
class EarlySlot:
    """cuda-ipc prefill: what one early announcement names, reused in turn: IPC events (and
    their handles) recorded after the prompt's last layer and after its first token's copy into
    the slot of the first-token buffer of the same index."""

    kv_event: torch.cuda.Event
    kv_handle: bytes
    token_event: torch.cuda.Event
    token_handle: bytes


@dataclass
class ReadyCopy:
    """A GPU-direct load whose hold is in: the engine thread queues its copy. An early one
    is reported once both its copy is queued and its announcement proper is in, by whichever
    thread sees the second (the flags change under the connector's lock)."""

    spec: LoadSpec
    hold: TransferHold
    remote_cache: torch.Tensor  # the prefill worker's mapped cache
    handed_off: HandedOffToken | None
    started: float  # time.monotonic() when the transfer's time starts
    after: torch.cuda.Event | None = None  # early: the prefill's event the copy waits for
    first_token: torch.Tensor | None = None  # early: the prefill's slot of it, mapped here
    token_event: torch.cuda.Event | None = None  # early: recorded after the token's copy there
    # run ahead: recorded after the step's read of that slot, which the confirmation waits for
    slot_read: torch.cuda.Event | None = None
    announced: bool = True  # early: False until the announcement proper is in
    launched: bool = False  # the engine thread has queued the copy (or given it up)
    failure: str | None = None
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # the copy's, if queued
    queued_at: float = 0.0


@dataclass
class ConnectorMetadata:
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # run-ahead handoffs: (index of the first token's stand-in in the step's inputs, request id)
    device_inputs: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class Lease:
    deadline: float
    num_blocks: int
    num_bytes: int
    staging: list[torch.Tensor]
    events: list[Any] = field(default_factory=list)  # CUDA events, one per layer
    transferable: bool = False  # the prefill is done and its transfer parameters went out
    held: bool = False  # a decode worker reads the blocks (cuda-ipc): it ends when it lets go
    early_slot: int | None = None  # cuda-ipc: the early announcement's slot, free once it ends


def transport_params(request: Request) -> dict[str, Any]:
    return request.kv_transfer_params or {}


def load_failure(request_id: str, exc: Exception) -> str:
    """The failure kind a load reports for `exc` (the transport's kind, or "error" with its
    traceback logged: not the transport's)."""
    if isinstance(exc, KVTransferError):
        logger.warning("KV load of %s failed: %s", request_id, exc)
        return exc.kind
    logger.error("KV load of %s failed", request_id, exc_info=exc)
    return "error"


def announced_token(message: dict[str, Any]) -> HandedOffToken:
    """The first token a handoff's announcement carries; KVTransferError when the prefill
    gave up or the message is not one."""
    if "error" in message:
        raise KVTransferError("aborted", f"the prefill worker gave up: {message['error']}")
    if message.get("finish_reason") not in (None, "stop"):
        raise KVTransferError("mismatch", f"an announcement with {message['finish_reason']!r}")
    try:
        return HandedOffToken(
            int(message["first_token_id"]), message.get("finish_reason"), message.get("stop_reason")
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise KVTransferError("mismatch", f"a malformed announcement: {exc!r}") from exc


class PDConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, kv_spec, device: torch.device) -> None:
        self.config = config
        self.recompute_on_failure = config.load_failure_policy == "recompute"
        self.kv_spec = kv_spec
        self.block_size = kv_spec.block_size
        self.device = device
        self.kv_cache: torch.Tensor | None = None
        self.lock = threading.Lock()
        # prefill side
        self.remote_decode: dict[str, Request] = {}
        self.leases: dict[str, Lease] = {}  # published transfers, by request id
        self.server = None
        # decode side
        self.load_attempted: set[str] = set()
        self.new_loads: list[LoadSpec] = []
        self.loading: set[str] = set()
        self.abandoned_loads: set[str] = set()
        self.cancelled_waits: dict[str, threading.Event] = {}  # handoffs waiting on a prefill
        self.ready_copies: list[ReadyCopy] = []  # held GPU-direct loads, for the engine thread
        self.client = None
        self.executor: ThreadPoolExecutor | None = None
        self.confirmations: ThreadPoolExecutor | None = None  # cuda-ipc: after each copy
        # reports, filled by transport threads, drained by get_finished / stats
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: dict[str, str] = {}
        self.first_tokens: dict[str, HandedOffToken] = {}
        self.counters = dict.fromkeys(
            (
                "kv_bytes_sent",
                "kv_blocks_sent",
                "kv_bytes_received",
                "kv_blocks_received",
                "kv_handoffs_early",
                "kv_handoffs_ahead",
            ),
            0,
        )
        self.new_transfer_seconds: list[float] = []
        self.new_failures: dict[str, int] = {}
        self.wakeup: Callable[[], None] = lambda: None
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ipc_handle: str | None = None
        self.early_slots: list[EarlySlot] = []  # cuda-ipc prefill: early announcements
        self.free_early_slots: deque[int] = deque()  # ... those no lease names
        self.first_token_slots: torch.Tensor | None = None  # ... their first-token buffer
        self.first_token_handle: str | None = None
        self.announced_early: dict[str, int] = {}  # request id -> slot, until its token is in
        self.remote_first_tokens: dict[str, torch.Tensor] = {}  # engine id -> mapped slots
        self.first_tokens_on_device: set[str] = set()  # reports: copies queued ahead
        self.ahead_copies: dict[str, ReadyCopy] = {}  # ... kept for write_device_inputs
        self.remote_caches: dict[str, torch.Tensor] = {}  # cuda-ipc: engine id -> mapped cache
        self.remote_events: dict[bytes, torch.cuda.Event] = {}  # opened prefill ready events
        self.block_copier = None  # cuda-ipc, decode side: queues the copies into kv_cache
        self.engine_stream: torch.cuda.Stream | None = None  # decode side: the steps' stream
        self._start_transport()

    @property
    def gpu_direct(self) -> bool:
        return self.config.transport == "cuda-ipc"

    def _start_transport(self) -> None:
        """TCP carries the bytes (tcp) or only the control messages (cuda-ipc)."""
        if self.gpu_direct and self.device.type != "cuda":
            raise ValueError("the cuda-ipc KV transport needs --device cuda")
        from tandem.kv.tcp_transport import TcpKVClient, TcpKVServer

        if self.config.serves_kv:
            fault = TransportFault.parse(self.config.fault) if self.config.fault else None
            self.server = TcpKVServer(
                self.config.host,
                self.config.port,
                on_transfer_done=self._on_transfer_done,
                on_transfer_held=self._on_transfer_held,
                fault=fault,
                cluster_token=self.config.cluster_token,
            )
            logger.info("KV server listening on %s:%d", self.config.host, self.server.port)
        if self.config.loads_kv:
            self.client = TcpKVClient(
                cluster_token=self.config.cluster_token, on_retry=self._count_retry
            )
            self.executor = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-load")
            if self.gpu_direct:
                self.confirmations = ThreadPoolExecutor(
                    CONFIRM_THREADS, thread_name_prefix="kv-confirm"
                )

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        params = transport_params(request)
        if params.get("do_remote_decode") and self.server is not None:
            self.remote_decode[request.request_id] = request
            return 0, False
        if (
            params.get("do_remote_prefill")
            and self.client is not None
            and request.request_id not in self.load_attempted
        ):
            # Load even when the local prefix cache holds the whole prompt (num_remote == 0): the
            # fetch is the confirmation that frees the prefill worker's lease.
            return max(request.num_prompt_tokens - num_local, 0), True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external: int
    ) -> None:
        self.load_attempted.add(request.request_id)  # only now: a failed allocation retries
        num_prompt_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        first_block = (request.num_prompt_tokens - num_external) // self.block_size
        self.new_loads.append(
            LoadSpec(
                request.request_id,
                transport_params(request),
                block_ids[first_block:num_prompt_blocks],
                first_block,
                request.num_prompt_tokens,
            )
        )

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        saves = [
            SaveSpec(
                item.request_id,
                item.block_ids[: cdiv(item.start_position + len(item.token_ids), self.block_size)],
            )
            for item in scheduled
            if item.sample and item.output_index == 0 and item.request_id in self.remote_decode
        ]
        loads, self.new_loads = self.new_loads, []
        device_inputs, offset = [], 0
        for item in scheduled:
            if item.first_token_on_device:
                device_inputs.append((offset, item.request_id))
            offset += len(item.token_ids)
        return ConnectorMetadata(saves, loads, device_inputs)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self.load_attempted.discard(request_id)
        self.announced_early.pop(request_id, None)
        with self.lock:
            self.ahead_copies.pop(request_id, None)
            if request_id in self.loading:  # the load thread still writes into these blocks
                self.abandoned_loads.add(request_id)
                if request_id in self.cancelled_waits:
                    self.cancelled_waits[request_id].set()
                return True, None
        if self.remote_decode.pop(request_id, None) is None:
            self._announce_no_transfer(request)
            return False, None
        with self.lock:
            lease = self.leases.get(request_id)
        if (
            lease is None
            or request.status != RequestStatus.FINISHED_LENGTH
            or request.num_output_tokens != 1
        ):
            # Held after an early announcement, the blocks stay until the decode lets go.
            with self.lock:
                held = lease is not None and lease.held
            self._end_lease(request_id, report=False)
            self._announce_no_transfer(request)
            return held, None
        with self.lock:
            lease.deadline = time.monotonic() + self.config.lease_timeout_s
            lease.transferable = True
        params = self._transfer_params(request, block_ids)
        if (handoff_id := self._handoff_id(request)) is not None:
            self.server.announce(handoff_id, params, transfer_id=request_id)
        return True, params

    def _transfer_params(self, request: Request, block_ids: list[int]) -> dict[str, Any]:
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": block_ids[:num_blocks],
            "remote_host": self.config.host,
            "remote_port": self.server.port,
            "tp_size": 1,
            "kv_transport": self.config.transport,
            "num_prompt_tokens": request.num_prompt_tokens,
            "block_size": self.block_size,
            "kv_layout": self.kv_layout,
            "kv_ipc_handle": self.ipc_handle,
        }
        if request.output_token_ids:  # none yet in an early announcement
            params["first_token_id"] = request.output_token_ids[0]
        return params

    def _handoff_id(self, request: Request) -> str | None:
        """Prefill side: the id a decode worker waits on for this request, if one does."""
        params = transport_params(request)
        if self.server is None or not params.get("do_remote_decode"):
            return None
        return params.get("handoff_id")

    def _announce_no_transfer(self, request: Request) -> None:
        """A prefill that ends without KV to hand off: its first token if that token ended the
        request, or why it gave up."""
        handoff_id = self._handoff_id(request)
        if handoff_id is None:
            return
        if request.status == RequestStatus.FINISHED_STOPPED and request.num_output_tokens == 1:
            message = {
                "first_token_id": request.output_token_ids[0],
                "finish_reason": "stop",
                "stop_reason": request.stop_reason,
            }
        else:
            message = {"error": f"the prefill ended without its KV ({request.status.value})"}
        self.server.announce(handoff_id, message)

    @property
    def kv_layout(self) -> str:
        spec = self.kv_spec
        dtype = str(spec.dtype).removeprefix("torch.")
        return f"{spec.num_layers}x2x{spec.num_kv_heads}x{spec.head_dim}:{dtype}"

    # -- worker side -----------------------------------------------------------------------------

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        if self.gpu_direct and self.config.serves_kv:
            from tandem.kv.cuda_ipc import export_handle

            self.ipc_handle = export_handle(kv_cache)
            with torch.cuda.device(self.device):
                events = [torch.cuda.Event(interprocess=True) for _ in range(2 * EARLY_SLOTS)]
            handles = [bytes(event.ipc_handle()) for event in events]
            self.early_slots = [
                EarlySlot(events[i], handles[i], events[i + 1], handles[i + 1])
                for i in range(0, len(events), 2)
            ]
            self.free_early_slots = deque(range(EARLY_SLOTS))
            self.first_token_slots = torch.zeros(EARLY_SLOTS, dtype=torch.int64, device=self.device)
            self.first_token_handle = export_handle(self.first_token_slots)
        if self.gpu_direct and self.config.loads_kv:
            from tandem.kv.cuda_ipc import BlockCopier

            self.block_copier = BlockCopier(kv_cache)
            self.engine_stream = torch.cuda.current_stream(self.device)

    def save_kv_layer(self, layer_index: int, metadata: ConnectorMetadata | None) -> None:
        if metadata is None or not metadata.saves:
            return
        for spec in metadata.saves:
            if layer_index == 0:
                self._publish(spec)
            if self.gpu_direct:  # decode reads the cache itself, announced once all is queued
                if layer_index == self.kv_spec.num_layers - 1:
                    self._announce_early(spec)
                continue
            lease = self.leases.get(spec.request_id)
            if lease is None:
                continue
            index = torch.tensor(spec.block_ids, device=self.device)
            source = self.kv_cache[layer_index]  # [2, num_blocks, block_size, heads, dim]
            if self.copy_stream is None:
                torch.index_select(source, 1, index, out=lease.staging[layer_index])
                continue
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                gathered = source.index_select(1, index)
                lease.staging[layer_index].copy_(gathered, non_blocking=True)
                lease.events[layer_index].record(self.copy_stream)

    def saves_between_layers(self, metadata: ConnectorMetadata | None) -> bool:
        """The TCP transport's saves copy each layer's blocks out while the next layers run;
        cuda-ipc's only publish the lease and announce it, which may wait for the whole pass."""
        return bool(metadata is not None and metadata.saves) and not self.gpu_direct

    def _publish(self, spec: SaveSpec) -> None:
        num_layers = 0 if self.gpu_direct else self.kv_spec.num_layers
        shape = (2, len(spec.block_ids), *self.kv_cache.shape[3:])
        pin = self.device.type == "cuda"
        staging = [
            torch.empty(shape, dtype=self.kv_cache.dtype, pin_memory=pin) for _ in range(num_layers)
        ]
        events = [torch.cuda.Event() for _ in range(num_layers)] if pin else []
        lease = Lease(
            deadline=time.monotonic() + self.config.lease_timeout_s,
            num_blocks=len(spec.block_ids),
            num_bytes=sum(t.numel() * t.element_size() for t in staging),
            staging=staging,
            events=events,
        )
        wait_layer = (lambda i: events[i].synchronize()) if pin else None
        with self.lock:
            self.leases[spec.request_id] = lease
        self.server.publish(spec.request_id, staging, wait_layer)

    def sampled_on_device(
        self,
        metadata: ConnectorMetadata | None,
        requests: Sequence[ScheduledRequest],
        token_ids: torch.Tensor,
    ) -> None:
        """cuda-ipc: the first tokens of prompts announced early are queued on the GPU: each
        is copied into its slot, and a further early announcement names the event after it."""
        if metadata is None or not metadata.saves or not self.announced_early:
            return
        rows = {request.request_id: row for row, request in enumerate(requests)}
        stream = torch.cuda.current_stream(self.device)
        for spec in metadata.saves:
            slot_index = self.announced_early.pop(spec.request_id, None)
            if slot_index is None:
                continue
            slot = self.early_slots[slot_index]
            self.first_token_slots[slot_index].copy_(token_ids[rows[spec.request_id]])
            slot.token_event.record(stream)
            handoff_id = self._handoff_id(self.remote_decode[spec.request_id])
            self.server.announce_more(handoff_id, {"kv_first_token_event": slot.token_handle})

    def _announce_early(self, spec: SaveSpec) -> None:
        """A decode worker that waits for this handoff already gets the blocks now, with an
        event to queue its copy behind and the slot the first token will be copied into. The
        slot is the lease's until it ends (the decode reads it before it confirms); with none
        free, the handoff waits for the announcement proper."""
        request = self.remote_decode.get(spec.request_id)
        handoff_id = self._handoff_id(request) if request is not None else None
        if handoff_id is None:
            return
        with self.lock:
            lease = self.leases.get(spec.request_id)
            if lease is None or not self.free_early_slots:
                return
            slot_index = lease.early_slot = self.free_early_slots.popleft()
            lease.transferable = True  # a hold may come with the early announcement
        slot = self.early_slots[slot_index]
        slot.kv_event.record(torch.cuda.current_stream(self.device))
        message = dict(
            self._transfer_params(request, spec.block_ids),
            kv_ready_event=slot.kv_handle,
            kv_first_token_slots=self.first_token_handle,
            kv_first_token_slot=slot_index,
        )
        if self.server.announce_early(handoff_id, spec.request_id, message):
            self.announced_early[spec.request_id] = slot_index
        else:
            with self.lock:
                lease.transferable = False
                lease.early_slot = None
                self.free_early_slots.append(slot_index)

    def start_load_kv(self, metadata: ConnectorMetadata | None) -> None:
        if metadata is None:
            return
        for spec in metadata.loads:
            with self.lock:
                self.loading.add(spec.request_id)
                if is_pending_handoff(spec.remote):
                    self.cancelled_waits[spec.request_id] = threading.Event()
            self.executor.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        """Receive one request's prompt KV into its local blocks (load thread), then report.
        A handoff first waits for the prefill's announcement; the transfer's time counts from
        there. A GPU-direct load ends here once it holds the prefill's lease: the engine thread
        queues the copy and reports (`_start_ready_copies`)."""
        started = time.monotonic()
        handed_off: HandedOffToken | None = None
        hold: TransferHold | None = None
        num_bytes = None  # None: a failure, or a prefill done on its first token (nothing loaded)
        try:
            if is_pending_handoff(spec.remote):
                spec.remote, handed_off, hold = self._await_handoff(spec)
                started = time.monotonic()
            if handed_off is None or handed_off.finish_reason is None:
                self._check_compatible(spec.remote, spec.num_prompt_tokens)
                if self.gpu_direct:
                    if hold is None:  # vLLM's flow, or an announcement that came without it
                        hold = self._hold_lease(spec.remote)
                    remote_cache = self._remote_cache(spec.remote)
                    ready = ReadyCopy(spec, hold, remote_cache, handed_off, started)
                    if hold.announcement_pending:
                        ready.after = self._remote_event(spec.remote["kv_ready_event"])
                        ready.first_token = self._remote_first_token(spec.remote)
                        if token_handle := spec.remote.get("kv_first_token_event"):
                            ready.token_event = self._remote_event(token_handle)
                        ready.announced = False
                    with self.lock:
                        self.ready_copies.append(ready)
                    self.wakeup()
                    if not ready.announced:
                        self._await_announcement(ready)
                    return
                num_bytes = self._receive_tcp(spec)
            failure = None
        except Exception as exc:
            failure = load_failure(spec.request_id, exc)
        if failure is not None and hold is not None:
            hold.abandon()
        seconds = time.monotonic() - started if num_bytes is not None else None
        self._report_load(spec, handed_off, failure, num_bytes, seconds)
        self.wakeup()

    def _report_load(
        self,
        spec: LoadSpec,
        handed_off: HandedOffToken | None,
        failure: str | None,
        num_bytes: int | None,
        seconds: float | None,
    ) -> None:
        """A load has ended: get_finished reports it (an abandoned one frees its blocks)."""
        with self.lock:
            self.loading.discard(spec.request_id)
            self.cancelled_waits.pop(spec.request_id, None)
            if num_bytes is not None:
                self.counters["kv_bytes_received"] += num_bytes
                self.counters["kv_blocks_received"] += len(spec.remote["remote_block_ids"])
            if seconds is not None:
                self.new_transfer_seconds.append(seconds)
            if failure is not None:
                self.new_failures[failure] = self.new_failures.get(failure, 0) + 1
            if spec.request_id in self.abandoned_loads:
                self.abandoned_loads.discard(spec.request_id)
                self.finished_sending.add(spec.request_id)  # frees the blocks it held
                return
            if handed_off is not None:
                self.first_tokens[spec.request_id] = handed_off
            if failure is None:
                self.finished_recving.add(spec.request_id)
            else:
                self.failed_recving[spec.request_id] = failure

    def _await_handoff(
        self, spec: LoadSpec
    ) -> tuple[dict[str, Any], HandedOffToken | None, TransferHold | None]:
        """Wait for the prefill's announcement: its transfer params and first token, and for a
        GPU-direct load the hold on its lease when the announcement came with it. An early
        announcement (the hold says so) has no first token yet: None."""
        remote = spec.remote
        wait = dict(
            timeout=self.config.handoff_timeout_s,
            cancelled=self.cancelled_waits.get(spec.request_id),
        )
        address = (remote["remote_host"], int(remote["remote_port"]), remote["handoff_id"])
        hold = None
        if self.gpu_direct:
            hold_timeout = self.config.transfer_timeout_s
            message, hold = self.client.await_held_announcement(
                *address, hold_timeout=hold_timeout, early=True, **wait
            )
            if hold is not None and hold.announcement_pending:
                return message, None, hold
        else:
            message = self.client.await_announcement(*address, **wait)
        try:
            token = announced_token(message)
        except BaseException:
            if hold is not None:
                hold.abandon()
            raise
        return message, token, hold

    def _await_announcement(self, copy: ReadyCopy) -> None:
        """Load thread, after an early announcement: wait for the announcement proper (the
        first token), then report the load, or leave that to the engine thread if it has not
        queued the copy yet. A further early announcement on the way names the event after
        the first token's copy into its slot: the request may then run ahead of the proper."""
        spec = copy.spec
        token, failure = None, None
        cancelled = self.cancelled_waits.get(spec.request_id)
        try:
            message = copy.hold.announcement(cancelled)
            while copy.hold.announcement_pending:
                if token_handle := message.get("kv_first_token_event"):
                    token_event = self._remote_event(token_handle)
                    with self.lock:
                        copy.token_event = token_event
                        ahead = self._run_ahead(copy)
                    if ahead:
                        self.wakeup()
                message = copy.hold.announcement(cancelled)
            token = announced_token(message)
        except Exception as exc:
            failure = load_failure(spec.request_id, exc)
        with self.lock:
            copy.handed_off = token
            copy.failure = copy.failure or failure
            copy.announced = True
            launched = copy.launched
        if launched:
            self._finish_copy(copy)
            self.wakeup()

    def _confirm_fetch(self, spec: LoadSpec, layers: list[torch.Tensor], on_layer=None) -> None:
        remote = spec.remote
        self.client.fetch(
            remote["remote_host"],
            int(remote["remote_port"]),
            remote["remote_request_id"],
            layers,
            timeout=self.config.transfer_timeout_s,
            on_layer=on_layer,
        )

    def _receive_tcp(self, spec: LoadSpec) -> int:
        """Every layer of the prompt's blocks over TCP into host staging, each scattered into
        the local blocks as it arrives (host -> device on a side stream)."""
        if not spec.local_block_ids:  # the local prefix cache holds the whole prompt
            self._release_remote(spec.remote)
            return 0
        num_remote_blocks = len(spec.remote["remote_block_ids"])
        shape = (2, num_remote_blocks, *self.kv_cache.shape[3:])
        pin = self.device.type == "cuda"
        staging = [
            torch.empty(shape, dtype=self.kv_cache.dtype, pin_memory=pin)
            for _ in range(self.kv_spec.num_layers)
        ]
        targets = torch.tensor(spec.local_block_ids, dtype=torch.long, device=self.device)
        stream = torch.cuda.Stream(self.device) if pin else None

        def on_layer(layer_index: int) -> None:
            received = staging[layer_index][:, spec.first_block :]
            if stream is None:
                self.kv_cache[layer_index].index_copy_(1, targets, received)
                return
            with torch.cuda.stream(stream):
                on_device = received.to(self.device, non_blocking=True)
                self.kv_cache[layer_index].index_copy_(1, targets, on_device)

        try:
            self._confirm_fetch(spec, staging, on_layer)
        finally:  # also on failure: the blocks are freed next, no copy may still write to them
            if stream is not None:
                stream.synchronize()
        return sum(t.numel() * t.element_size() for t in staging)

    def _hold_lease(self, remote: dict[str, Any]) -> TransferHold:
        """A hold on the prefill's lease, once the prefill worker holds it."""
        hold = self.client.hold(
            remote["remote_host"],
            int(remote["remote_port"]),
            remote["remote_request_id"],
            timeout=self.config.transfer_timeout_s,
        )
        try:
            hold.wait()
        except BaseException:
            hold.abandon()
            raise
        return hold

    def _remote_cache(self, remote: dict[str, Any]) -> torch.Tensor:
        """The prefill worker's KV cache, mapped on its first transfer."""
        return self._mapped(self.remote_caches, remote, "kv_ipc_handle")

    def _mapped(
        self, mappings: dict[str, torch.Tensor], remote: dict[str, Any], handle_key: str
    ) -> torch.Tensor:
        """A tensor of the prefill worker's that `remote[handle_key]` exports over CUDA IPC,
        mapped on our GPU on its first use (kept in `mappings`, by prefill engine)."""
        from tandem.kv.cuda_ipc import open_handle

        engine_id = remote["remote_engine_id"]
        if engine_id not in mappings:
            mappings[engine_id] = open_handle(remote[handle_key], self.device)
        return mappings[engine_id]

    def _remote_event(self, handle: bytes) -> torch.cuda.Event:
        """A prefill's event that an early copy or step waits for, opened on its first use, on
        our GPU (a stream here waiting on one opened on the prefill's GPU crashed the process)."""
        if handle not in self.remote_events:
            self.remote_events[handle] = torch.cuda.Event.from_ipc_handle(self.device, handle)
        return self.remote_events[handle]

    def _remote_first_token(self, remote: dict[str, Any]) -> torch.Tensor | None:
        """The slot of the prefill's first-token buffer an early announcement names, mapped
        on our GPU (the buffer on its first use); None from a prefill that names none."""
        if "kv_first_token_slots" not in remote:
            return None
        slots = self._mapped(self.remote_first_tokens, remote, "kv_first_token_slots")
        slot = int(remote["kv_first_token_slot"])
        return slots[slot : slot + 1]

    def _start_ready_copies(self) -> None:
        """Engine thread: queue the copies of the held GPU-direct loads on the GPU and report
        them loaded (an early one once its announcement proper is in too); a load whose request
        went away meanwhile, or whose prefill gave up, only frees its blocks."""
        with self.lock:
            ready, self.ready_copies = self.ready_copies, []
        for copy in ready:
            spec = copy.spec
            remote_ids = spec.remote["remote_block_ids"][spec.first_block :]
            with self.lock:
                skip = spec.request_id in self.abandoned_loads or copy.failure is not None
            copy.queued_at = time.monotonic()
            failure = None
            try:
                if remote_ids and not skip:  # none: the local prefix cache holds them all
                    copy.events = self.block_copier.launch(
                        copy.remote_cache, remote_ids, spec.local_block_ids, after=copy.after
                    )
            except Exception:
                failure = "error"
                logger.exception("KV copy of %s failed", spec.request_id)
            with self.lock:
                copy.failure = copy.failure or failure
                copy.launched = True
                announced = copy.announced
                if not announced:
                    self._run_ahead(copy)
            if announced:
                self._finish_copy(copy)

    def _run_ahead(self, copy: ReadyCopy) -> bool:
        """With the lock held: report an early copy whose request's first step may run before
        the announcement proper, once the copy is queued and the first token's event known."""
        ready = copy.launched and not copy.announced and copy.failure is None
        ready = ready and copy.first_token is not None and copy.token_event is not None
        if not ready or copy.spec.request_id in self.abandoned_loads:
            return False
        self.ahead_copies[copy.spec.request_id] = copy
        self.first_tokens_on_device.add(copy.spec.request_id)
        return True

    def write_device_inputs(self, metadata: ConnectorMetadata | None, input_ids: torch.Tensor):
        """Put the first tokens of this step's run-ahead handoffs in their stand-ins' places,
        read from the prefill's GPU once their KV copies are done and the tokens are in their
        slots (the step waits for both); a token announced meanwhile is written from here. A
        read is queued before the announcement proper is taken in (under the lock), so the
        confirmation, which follows that announcement, waits for it: the prefill reuses the
        slot only once the lease ends."""
        if metadata is None or not metadata.device_inputs:
            return
        with self.lock:
            for offset, request_id in metadata.device_inputs:
                copy = self.ahead_copies.pop(request_id)
                self.counters["kv_handoffs_ahead"] += 1
                self.engine_stream.wait_event(copy.events[1] if copy.events else copy.after)
                stand_in = input_ids[offset : offset + 1]
                if copy.announced:  # the token or the failure is in: the slot is not read
                    if copy.handed_off is not None:
                        stand_in.fill_(copy.handed_off.token_id)
                    continue
                self.engine_stream.wait_event(copy.token_event)
                stand_in.copy_(copy.first_token)
                copy.slot_read = torch.cuda.Event()
                copy.slot_read.record(self.engine_stream)

    def _finish_copy(self, copy: ReadyCopy) -> None:
        """Report a GPU-direct load whose copy is queued (unless given up) and whose first
        token is known. The prefill's lease is confirmed from a thread once the copy is done;
        one with no copy on the way and a failure only lets go of it."""
        spec = copy.spec
        remote_ids = spec.remote["remote_block_ids"][spec.first_block :]
        if copy.after is not None and copy.events is not None:
            self.engine_stream.wait_event(copy.events[1])  # before the report lets work use it
        with self.lock:
            abandoned = spec.request_id in self.abandoned_loads
        ended_on_first = copy.handed_off is not None and copy.handed_off.finish_reason is not None
        loaded = copy.failure is None and not abandoned and not ended_on_first
        num_bytes = len(remote_ids) * self.kv_spec.bytes_per_block if loaded else None
        self._report_load(spec, copy.handed_off, copy.failure, num_bytes, None)
        if copy.failure is not None and copy.events is None:
            copy.hold.abandon()
            return
        since_start = None
        if loaded:  # an early copy's host work overlapped the prefill: its GPU time only counts
            since_start = 0.0 if copy.after is not None else copy.queued_at - copy.started
        self.confirmations.submit(self._confirm_copy, copy, copy.events, since_start)

    def _confirm_copy(
        self,
        copy: ReadyCopy,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None,
        seconds: float | None,
    ) -> None:
        """Confirmation thread: once the copy is done, record the transfer's time (`seconds`
        until the copy was queued, plus the copy on the GPU; None: not a load) and confirm,
        after a run-ahead step's read of the prefill's first-token slot, if one was queued."""
        if events is not None:
            queued, done = events
            done.synchronize()
            if seconds is not None:
                seconds += queued.elapsed_time(done) / 1e3
        if copy.slot_read is not None:
            copy.slot_read.synchronize()
        if seconds is not None:
            with self.lock:
                self.new_transfer_seconds.append(seconds)
        self._confirm_held(copy.spec, copy.hold)

    def _confirm_held(self, spec: LoadSpec, hold: TransferHold) -> None:
        """Confirms a GPU-direct load (after its report): the prefill worker frees the blocks.
        If that fails, the prefill's lease lets go of them when it expires."""
        try:
            hold.release()
        except KVTransferError as exc:
            logger.warning("confirming the KV load of %s failed: %s", spec.request_id, exc)

    def _check_compatible(self, remote: dict[str, Any], num_prompt_tokens: int) -> None:
        if remote.get("kv_transport", "tcp") != self.config.transport:
            raise KVTransferError(
                "mismatch", f"the prefill worker uses transport {remote.get('kv_transport')!r}"
            )
        if remote.get("block_size") != self.block_size or remote.get("kv_layout") != self.kv_layout:
            raise KVTransferError(
                "mismatch",
                f"the prefill worker's KV layout ({remote.get('kv_layout')}, block size "
                f"{remote.get('block_size')}) differs from this worker's ({self.kv_layout}, "
                f"block size {self.block_size})",
            )
        if remote.get("num_prompt_tokens", num_prompt_tokens) != num_prompt_tokens:
            raise KVTransferError(
                "mismatch",
                f"the prefill worker computed {remote.get('num_prompt_tokens')} prompt tokens, "
                f"this worker has {num_prompt_tokens} (do both serve the same model?)",
            )

    def get_finished(self) -> KVConnectorOutput | None:
        if self.ready_copies:
            self._start_ready_copies()
        now = time.monotonic()
        with self.lock:
            expired = [
                rid for rid, lease in self.leases.items() if lease.deadline < now and not lease.held
            ]
        for request_id in expired:
            logger.info("KV lease of %s expired", request_id)
            self._end_lease(request_id, report=True)
        with self.lock:
            if not (
                self.finished_sending
                or self.finished_recving
                or self.failed_recving
                or self.first_tokens_on_device
            ):
                return None
            output = KVConnectorOutput(
                self.finished_recving,
                self.failed_recving,
                self.finished_sending,
                self.first_tokens,
                self.first_tokens_on_device,
            )
            self.finished_recving, self.failed_recving, self.finished_sending = set(), {}, set()
            self.first_tokens, self.first_tokens_on_device = {}, set()
        return output

    # -- both sides ------------------------------------------------------------------------------

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        self.wakeup = callback

    def _on_transfer_done(self, request_id: str, ok: bool) -> None:
        """Transport thread: the decode confirmed (ok) or a fetch or hold broke (not ok: the
        lease stays, no longer held, until it is confirmed, released or expires: the decode
        may try again meanwhile)."""
        if not ok:
            with self.lock:
                self.new_failures["send"] = self.new_failures.get("send", 0) + 1
                lease = self.leases.get(request_id)
                if lease is not None:
                    lease.held = False
            return
        with self.lock:
            lease = self._pop_lease(request_id)
            if lease is None:
                return
            self.counters["kv_bytes_sent"] += lease.num_bytes
            self.counters["kv_blocks_sent"] += lease.num_blocks
            self.finished_sending.add(request_id)
        self.wakeup()

    def _count_retry(self) -> None:
        """Transport thread: a request on the KV port broke and is tried again."""
        with self.lock:
            self.new_failures["retried"] = self.new_failures.get("retried", 0) + 1

    def _on_transfer_held(self, request_id: str) -> bool:
        """Transport thread: a decode worker reads the blocks itself and asks that they stay
        until it confirms; False once the lease has ended (or before its prefill is done)."""
        with self.lock:
            lease = self.leases.get(request_id)
            if lease is None or not lease.transferable:
                return False
            lease.held = True
            return True

    def _pop_lease(self, request_id: str) -> Lease | None:
        """With the lock held: a lease that ends, its early announcement's slot freed."""
        lease = self.leases.pop(request_id, None)
        if lease is not None and lease.early_slot is not None:
            self.free_early_slots.append(lease.early_slot)
        return lease

    def _end_lease(self, request_id: str, report: bool) -> None:
        """Ends a lease (expired, released, or not needed); a held one ends once let go."""
        with self.lock:
            lease = self.leases.get(request_id)
            if lease is not None and lease.held:
                lease.deadline = 0.0  # the first expiry check after the hold ends it
                return
            lease = self._pop_lease(request_id)
            if lease is not None and report:
                self.finished_sending.add(request_id)
        if lease is not None:
            self.server.withdraw(request_id)

    def release_remote(self, kv_transfer_params: dict[str, Any]) -> None:
        if self.client is not None:
            self.executor.submit(self._release_remote, kv_transfer_params)

    def _release_remote(self, remote: dict[str, Any]) -> None:
        try:
            self.client.release(
                remote["remote_host"],
                int(remote["remote_port"]),
                remote["remote_request_id"],
                timeout=self.config.transfer_timeout_s,
            )
        except KVTransferError as exc:  # the lease expires on its own
            logger.warning("releasing %s failed: %s", remote.get("remote_request_id"), exc)

    def release(self, remote_request_id: str) -> None:
        if remote_request_id in self.leases and remote_request_id not in self.remote_decode:
            self._end_lease(remote_request_id, report=True)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            stats: dict[str, Any] = dict(self.counters)
            stats["kv_blocks_leased"] = sum(lease.num_blocks for lease in self.leases.values())
            stats["kv_transfer_seconds"], self.new_transfer_seconds = self.new_transfer_seconds, []
            stats["kv_transfer_failures"], self.new_failures = self.new_failures, {}
        if self.server is not None:
            stats["kv_handoffs_early"] = self.server.early_announcements
        return stats

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        for pool in (self.executor, self.confirmations):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self.client is not None:
            self.client.close()


def connector_factory(config: KVTransferConfig):
    """What EngineCore calls, once its KV cache is planned, to build this worker's connector."""

    def build(core) -> PDConnector:
        return PDConnector(config, core.kv_spec, core.device)

    return build
