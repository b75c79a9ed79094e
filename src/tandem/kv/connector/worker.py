"""The PD connector's worker side: stages saves and runs loads on this rank's data plane.

Saves: the step that computes a prompt's last chunk stages its blocks (`DataPlane.stage`) and
publishes them on the control plane (opening the lease, with what the plane exports); each
layer's save_kv_layer copies that layer out where the plane copies (tcp).
Loads: a handoff first waits for its prefill's announcement (its params and first token; with a
plane that reads in place, the lease held for it), on a load thread; a plane that reads in
place then holds the prefill's lease while it reads (cuda-ipc: the engine thread queues the copy
at the start of its next step) and confirms once the copy is done, on a confirmation thread;
tcp's read confirms itself. Every load is reported once, in get_finished: finished_recving or
failed_recving (with the failure's kind), and a handoff's first token. On rank 0 of a
tensor-parallel engine (`attach_ranks`), over tcp, saves and reads carry every rank's KV heads
and a read is reported once every rank has installed its heads of it (`ranks`); over a plane
that reads in place, every rank reads its own heads and a read is reported once every rank's
reads have ended (`rank_reads`). A plane that reads in place reads a tensor-parallel prefill's
ranks (kv_rank_exports) on any engine (`start_rank_reads`).
Invariant: no thread of this side ever waits on the network while it holds the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch

from tandem.engine.outputs import HandedOffToken, KVConnectorOutput
from tandem.kv.config import KVTransferConfig
from tandem.kv.connector.base import KVConnectorWorker, RankKVTransfer
from tandem.kv.connector.metadata import (
    ForNextStep,
    InstallSpec,
    KVConnectorMetadata,
    LoadSpec,
    RankReadSpec,
    TransferShape,
    kv_layout,
)
from tandem.kv.connector.rank_reads import RankReads, load_failure, start_rank_reads
from tandem.kv.connector.ranks import HeadRelay, install_shards
from tandem.kv.control.client import Hold
from tandem.kv.control.plane import ControlPlane
from tandem.kv.data import data_plane_class
from tandem.kv.data.base import BlockSource, ReadHandle
from tandem.kv.errors import KVTransferError
from tandem.kv.params import KVTransferParams

logger = logging.getLogger(__name__)

LOAD_THREADS = 4
# Confirmations get threads of their own: on the load threads they could queue behind handoffs
# that wait for prefills, which may themselves wait for the blocks those confirmations free.
CONFIRM_THREADS = 4


def announced(message: dict[str, Any]) -> tuple[HandedOffToken, KVTransferParams | None]:
    """The first token a handoff's announcement carries, and the transfer's params unless that
    token ended the request; KVTransferError when the prefill gave up or it is not one."""
    if "error" in message:
        raise KVTransferError("aborted", f"the prefill worker gave up: {message['error']}")
    if message.get("finish_reason") not in (None, "stop"):
        raise KVTransferError("mismatch", f"an announcement with {message['finish_reason']!r}")
    try:
        token = HandedOffToken(
            int(message["first_token_id"]), message.get("finish_reason"), message.get("stop_reason")
        )
        params = None if token.finish_reason else msgspec.convert(message, KVTransferParams)
    except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
        raise KVTransferError("mismatch", f"a malformed announcement: {exc!r}") from exc
    return token, params


class PDConnectorWorker(KVConnectorWorker):
    def __init__(
        self,
        config: KVTransferConfig,
        kv_spec,
        device: torch.device,
        control: ControlPlane,
        shape: TransferShape,
        installs: ForNextStep,  # of InstallSpec: rank 0's host layers, then its report
        reads: ForNextStep,  # of RankReadSpec: what to call once every rank's reads ended
    ) -> None:
        self.config = config
        self.kv_spec = kv_spec
        self.block_size = kv_spec.block_size
        self.shape = shape
        self.layers, self.kv_heads = (0, kv_spec.num_layers), (0, kv_spec.num_kv_heads)
        self.control = control
        self.relay: HeadRelay | None = None  # several ranks over tcp: through rank 0
        self.rank_reads: RankReads | None = None  # several ranks reading in place: each its own
        self.installs = installs
        self.ready_reads = reads
        plane_class = data_plane_class(config.transport)
        self.plane = plane_class(
            device,
            config.transfer_timeout_s,
            control.client,
            lambda: control.wakeup(),
            advertised_host=config.host,
        )
        self.exported: dict[str, Any] = {}  # what saves publish (register_kv_cache's)
        self.lock = threading.Lock()
        self.loading: set[str] = set()
        self.abandoned: set[str] = set()
        self.waits: dict[str, threading.Event] = {}  # handoffs waiting on their prefill
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: dict[str, str] = {}
        self.first_tokens: dict[str, HandedOffToken] = {}
        self.loads: ThreadPoolExecutor | None = None
        self.confirmations: ThreadPoolExecutor | None = None
        if config.loads_kv:
            self.loads = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-load")
            if self.plane.reads_in_place:
                self.confirmations = ThreadPoolExecutor(
                    CONFIRM_THREADS, thread_name_prefix="kv-confirm"
                )

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.plane.register_kv_cache(kv_cache)
        self.exported = self.plane.export()
        if self.rank_reads is not None:  # a collective: every rank registers alike
            self.exported = {"kv_rank_exports": self.rank_reads.exchange()}

    def attach_ranks(self, relay: HeadRelay) -> RankKVTransfer:
        """A tensor-parallel engine's rank 0: transfers carry every rank's KV heads, through
        rank 0 (tcp) or read by each rank (a plane that reads in place); what the other ranks
        build their side from."""
        self.shape.kv_layout = kv_layout(self.kv_spec, relay.layout.num_kv_heads)
        self.shape.tp_size = relay.layout.size
        self.kv_heads = (0, relay.layout.num_kv_heads)
        if self.plane.reads_in_place:
            self.rank_reads = RankReads(relay.tp, relay.layout, self.plane)
        else:
            self.relay = relay
            self.plane.relay = relay
        config = self.config
        return RankKVTransfer(config.transport, config.host, config.transfer_timeout_s)

    # -- saves -----------------------------------------------------------------------------------

    def save_kv_layer(self, layer_index: int, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        for spec in metadata.saves:
            if layer_index == 0:
                staged = self.plane.stage(spec.request_id, spec.block_ids)
                num_blocks = len(spec.block_ids)
                block_bytes = None if staged.layers else self._model_block_bytes()
                self.control.publish(
                    spec.request_id, staged, num_blocks, self.exported, block_bytes
                )
            self.plane.save_layer(spec.request_id, layer_index)

    def saves_between_layers(self, metadata: KVConnectorMetadata | None) -> bool:
        return bool(metadata is not None and metadata.saves) and self.plane.saves_between_layers

    # -- loads -----------------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        for install in metadata.installs:  # every rank takes its heads of rank 0's reads
            layers, installed = self.installs.take_kept(install.request_id)
            install_shards(self.relay, self.plane.kv_cache, install, layers)
            installed()
        if self.rank_reads is not None:  # every rank starts its reads, then all poll them
            self.rank_reads.start(metadata.reads)
            for request_id, failure in self.rank_reads.poll():
                self.ready_reads.take_kept(request_id)(failure)
        with self.lock:
            for request_id in metadata.abandoned:
                if request_id in self.loading:
                    self.abandoned.add(request_id)
                    if request_id in self.waits:
                        self.waits[request_id].set()
        for spec in metadata.loads:
            waits = spec.remote.is_handoff
            with self.lock:
                self.loading.add(spec.request_id)
                if waits:
                    self.waits[spec.request_id] = threading.Event()
            if waits or self.plane.reads_in_place:  # they wait on the network
                self.loads.submit(self._load, spec)
            else:  # the read itself runs on the plane's threads
                self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        """Begin one request's load: a handoff first waits for the announcement (the transfer's
        time counts from there); the read reports through `_read_done`."""
        started = time.monotonic()
        remote, handed_off, hold = spec.remote, None, None
        try:
            if remote.is_handoff:
                handed_off, announced_params, hold = self._await_handoff(spec)
                if announced_params is None:  # the first token ended the request: no KV
                    self._report(spec, remote, handed_off)
                    return
                remote, started = announced_params, time.monotonic()
            self._check_compatible(remote, spec.num_prompt_tokens)
            if self.plane.reads_in_place and hold is None:
                hold = self._hold_lease(remote)
            with self.lock:
                abandoned = spec.request_id in self.abandoned
            if abandoned or not spec.local_block_ids:  # nothing to read (or no one to read for)
                self._confirm_unread(remote, hold)
                if not abandoned:
                    self.control.record_seconds(time.monotonic() - started)
                self._report(spec, remote, handed_off, num_bytes=None if abandoned else 0)
                return
            if self.rank_reads is not None:  # every rank reads its heads, from the next step
                read = RankReadSpec(spec.request_id, remote, spec.local_block_ids, spec.first_block)
                self.ready_reads.add(
                    read,
                    lambda failure: self._rank_reads_ended(
                        spec, remote, handed_off, hold, started, failure
                    ),
                )
                self.control.wakeup()
                return

            def on_done(read: ReadHandle) -> None:
                self._read_done(spec, remote, handed_off, hold, started, read)

            local_ids, first_block = spec.local_block_ids, spec.first_block
            if self.plane.reads_in_place:  # from every rank of the prefill that holds heads
                num_kv_heads = self.kv_heads[1]
                start_rank_reads(self.plane, remote, local_ids, first_block, num_kv_heads, on_done)
            else:
                self.plane.start_read(self._source(remote), local_ids, first_block, on_done)
        except Exception as exc:
            if hold is not None:
                hold.abandon()
            self._report(spec, remote, handed_off, failure=load_failure(spec.request_id, exc))

    def _source(self, remote: KVTransferParams) -> BlockSource:
        return BlockSource(
            remote.remote_engine_id,
            remote.remote_host,
            remote.remote_port,
            remote.remote_request_id,
            remote.remote_block_ids,
            remote.kv_layout,
            self.layers,
            self.kv_heads,
            {name: getattr(remote, name) for name in self.plane.export_fields},
        )

    def _read_done(
        self,
        spec: LoadSpec,
        remote: KVTransferParams,
        handed_off: HandedOffToken | None,
        hold: Hold | None,
        started: float,
        read: ReadHandle,
    ) -> None:
        """The plane's thread (tcp) or the engine thread (cuda-ipc): the read is done; report
        it, and confirm it once nothing reads the prefill's blocks any more."""
        try:
            num_bytes = read.result()
        except Exception as exc:
            if hold is not None:
                hold.abandon()
            self._report(spec, remote, handed_off, failure=load_failure(spec.request_id, exc))
            return
        if self.relay is not None:  # every rank installs its heads first, in the next step
            install = InstallSpec(spec.request_id, spec.local_block_ids)

            def report() -> None:
                self._report(spec, remote, handed_off, num_bytes=num_bytes)

            self.installs.add(install, (read.host_layers, report))
            self.control.record_seconds(time.monotonic() - started)
            self.control.wakeup()
            return
        seconds = time.monotonic() - started
        self._report(spec, remote, handed_off, num_bytes=num_bytes)
        if hold is None:
            self.control.record_seconds(seconds)
        else:
            self.confirmations.submit(self._confirm_read, spec, read, hold, seconds)

    def _rank_reads_ended(
        self,
        spec: LoadSpec,
        remote: KVTransferParams,
        handed_off: HandedOffToken | None,
        hold: Hold,
        started: float,
        failure: str | None,
    ) -> None:
        """The engine thread: every rank's reads of a load have ended (and their copies), or
        one rank's failed; report the load, and confirm it on a confirmation thread."""
        if failure is not None:
            logger.warning("KV load of %s failed on a rank (%s)", spec.request_id, failure)
            hold.abandon()
            self._report(spec, remote, handed_off, failure=failure)
            return
        num_bytes = len(spec.local_block_ids) * self._model_block_bytes()
        self._report(spec, remote, handed_off, num_bytes=num_bytes)
        seconds = time.monotonic() - started
        self.confirmations.submit(self._confirm_read, spec, None, hold, seconds)

    def _model_block_bytes(self) -> int:
        """The bytes of one block of every layer and all the model's KV heads."""
        cache = self.plane.kv_cache
        per_head = cache[:, :, 0].numel() // cache.shape[4] * cache.element_size()
        return per_head * self.kv_heads[1]

    def _confirm_read(
        self, spec: LoadSpec, read: ReadHandle | None, hold: Hold, seconds: float
    ) -> None:
        """Confirmation thread: once the copy is done (None: it is), record the transfer's time
        (until the copy was queued, plus the copy on the device) and confirm: the prefill frees
        the blocks. If that fails, the prefill's lease lets go of them when it expires."""
        self.control.record_seconds(seconds + (0.0 if read is None else read.wait_copied()))
        try:
            hold.release(len(spec.local_block_ids))
        except KVTransferError as exc:
            logger.warning("confirming the KV load of %s failed: %s", spec.request_id, exc)

    def _confirm_unread(self, remote: KVTransferParams, hold: Hold | None) -> None:
        """A load with nothing to read: the prefill's lease is done all the same."""
        if hold is None:
            self.control.release_remote(remote)
            return
        try:
            hold.release(0)
        except KVTransferError as exc:
            logger.warning("releasing %s failed: %s", remote.remote_request_id, exc)

    def _report(
        self,
        spec: LoadSpec,
        remote: KVTransferParams,
        handed_off: HandedOffToken | None,
        failure: str | None = None,
        num_bytes: int | None = None,
    ) -> None:
        """A load has ended: get_finished reports it (a failure under its kind); it received
        the blocks it lacked (local_block_ids), not those its prefix cache held."""
        self.control.record_load(len(spec.local_block_ids), num_bytes, failure)
        with self.lock:
            self.loading.discard(spec.request_id)
            self.abandoned.discard(spec.request_id)
            self.waits.pop(spec.request_id, None)
            if handed_off is not None:
                self.first_tokens[spec.request_id] = handed_off
            if failure is None:
                self.finished_recving.add(spec.request_id)
            else:
                self.failed_recving[spec.request_id] = failure
        self.control.wakeup()

    def _await_handoff(
        self, spec: LoadSpec
    ) -> tuple[HandedOffToken, KVTransferParams | None, Hold | None]:
        """Wait for the prefill's announcement: its first token, its transfer's params (None:
        that token ended the request), and the hold on its lease when it came with one."""
        remote = spec.remote
        client = self.control.client
        address = (remote.remote_host, remote.remote_port, remote.handoff_id)
        cancelled = self.waits.get(spec.request_id)
        wait = dict(
            timeout=self.config.handoff_timeout_s,
            cancelled=cancelled,
            engine_id=remote.remote_engine_id,
        )
        hold = None
        if self.plane.reads_in_place:
            hold_timeout = self.config.transfer_timeout_s
            message, hold = client.await_held_announcement(
                *address, hold_timeout=hold_timeout, **wait
            )
        else:
            message = client.await_announcement(*address, **wait)
        try:
            token, params = announced(message)
        except BaseException:
            if hold is not None:
                hold.abandon()
            raise
        return token, params, hold

    def _hold_lease(self, remote: KVTransferParams) -> Hold:
        """A hold on the prefill's lease, once the prefill worker holds it."""
        hold = self.control.client.hold(
            remote.remote_host,
            remote.remote_port,
            remote.remote_request_id,
            timeout=self.config.transfer_timeout_s,
        )
        try:
            hold.wait()
        except BaseException:
            hold.abandon()
            raise
        return hold

    def _check_compatible(self, remote: KVTransferParams, num_prompt_tokens: int) -> None:
        transport = remote.kv_transport or "tcp"
        if transport != self.config.transport:
            raise KVTransferError("mismatch", f"the prefill worker uses transport {transport!r}")
        if remote.block_size != self.block_size or remote.kv_layout != self.shape.kv_layout:
            raise KVTransferError(
                "mismatch",
                f"the prefill worker's KV layout ({remote.kv_layout}, block size "
                f"{remote.block_size}) differs from this worker's ({self.shape.kv_layout}, "
                f"block size {self.block_size})",
            )
        if remote.num_prompt_tokens not in (None, num_prompt_tokens):
            raise KVTransferError(
                "mismatch",
                f"the prefill worker computed {remote.num_prompt_tokens} prompt tokens, "
                f"this worker has {num_prompt_tokens} (do both serve the same model?)",
            )

    # -- reports ---------------------------------------------------------------------------------

    def get_finished(self) -> KVConnectorOutput | None:
        self.plane.start_queued_reads()
        ended = self.control.take_ended()
        for transfer_id, _ in ended:
            self.plane.withdraw(transfer_id)
        with self.lock:
            self.finished_sending.update(tid for tid, reported in ended if reported)
            if not (self.finished_sending or self.finished_recving or self.failed_recving):
                return None
            output = KVConnectorOutput(
                self.finished_recving, self.failed_recving, self.finished_sending, self.first_tokens
            )
            self.finished_recving, self.failed_recving, self.finished_sending = set(), {}, set()
            self.first_tokens = {}
        return output

    def shutdown(self) -> None:
        for pool in (self.loads, self.confirmations):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.plane.close()
