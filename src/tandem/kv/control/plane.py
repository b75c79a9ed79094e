"""The control plane as one engine holds it: its KV server (when it serves KV), its client (when
it loads KV), the leases on its published transfers, and the record of its transfers for
/metrics. It is engine-wide (with several ranks it lives with the scheduler, on rank 0); both
connector sides hold it: the scheduler side announces handoffs and ends leases through it at
once, the worker side publishes staged transfers and drains the ended leases.

Lease invariants: a lease is opened when its transfer is published (the prompt's last chunk is
computed) and made transferable when its request finishes; it ends once: confirmed by the decode
(reported), expired or released (reported, unless held: a held lease ends when let go), or not
needed (not reported: the request frees its own blocks). `take_ended` hands each ended lease
to the worker side once. Thread-safe: the server's connection threads call in.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.kv.config import KVTransferConfig
from tandem.kv.errors import KVTransferError

if TYPE_CHECKING:
    from tandem.kv.data.base import StagedTransfer
    from tandem.kv.params import KVTransferParams

logger = logging.getLogger(__name__)

RELEASE_THREADS = 2


@dataclass
class Lease:
    deadline: float
    num_blocks: int
    num_bytes: int  # what is staged for it (none where the decode reads the blocks in place)
    block_bytes: int  # one block of every layer
    exported: dict[str, Any] = field(default_factory=dict)  # the data plane's export()
    transferable: bool = False  # its request is done and its params went out
    held: bool = False  # a decode reads the blocks in place: it ends when let go


class ControlPlane:
    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.leases: dict[str, Lease] = {}
        self.ended: list[tuple[str, bool]] = []  # (transfer id, report it as finished sending)
        self.counters = dict.fromkeys(
            ("kv_bytes_sent", "kv_blocks_sent", "kv_bytes_received", "kv_blocks_received"), 0
        )
        self.new_transfer_seconds: list[float] = []
        self.new_served = dict.fromkeys(("kv_bytes_served", "kv_blocks_served"), 0)
        self.new_failures: dict[str, int] = {}
        self.wakeup = lambda: None
        self.server = None
        self.client = None
        self.releases: ThreadPoolExecutor | None = None
        if config.serves_kv:
            from tandem.kv.control.server import KVServer  # looked up now: tests replace it

            self.server = KVServer(
                config.host,
                config.port,
                on_transfer_done=self._on_transfer_done,
                on_transfer_held=self._on_transfer_held,
                on_transfer_served=self._on_transfer_served,
                cluster_token=config.cluster_token,
                engine_id=config.engine_id,
            )
            logger.info("KV server listening on %s:%d", config.host, self.server.port)
        if config.loads_kv:
            from tandem.kv.control.client import KVClient

            self.client = KVClient(cluster_token=config.cluster_token, on_retry=self._count_retry)
            self.releases = ThreadPoolExecutor(RELEASE_THREADS, thread_name_prefix="kv-release")

    @property
    def port(self) -> int | None:
        return self.server.port if self.server is not None else None

    def set_wakeup(self, callback) -> None:
        """callback() runs on a transport thread whenever the worker side has news."""
        self.wakeup = callback

    # -- leases (prefill side) -------------------------------------------------------------------

    def publish(
        self,
        transfer_id: str,
        staged: StagedTransfer,
        num_blocks: int,
        exported: dict[str, Any],
        block_bytes: int | None = None,
    ) -> None:
        """block_bytes: one block of every layer, where nothing is staged (in-place planes);
        else what is staged per block."""
        if block_bytes is None:
            block_bytes = staged.num_bytes // num_blocks if num_blocks else 0
        deadline = time.monotonic() + self.config.lease_timeout_s
        lease = Lease(deadline, num_blocks, staged.num_bytes, block_bytes, exported)
        with self.lock:
            self.leases[transfer_id] = lease
        self.server.publish(transfer_id, staged.layers, staged.wait_layer)

    def make_transferable(self, transfer_id: str) -> Lease | None:
        """Its request finished: the lease runs from now, and decode workers may hold it."""
        with self.lock:
            lease = self.leases.get(transfer_id)
            if lease is not None:
                lease.deadline = time.monotonic() + self.config.lease_timeout_s
                lease.transferable = True
        return lease

    def end_lease(self, transfer_id: str, report: bool) -> None:
        """End a lease (expired, released, or not needed); a held one ends once let go."""
        with self.lock:
            lease = self.leases.get(transfer_id)
            if lease is not None and lease.held:
                lease.deadline = 0.0  # the first expiry check after the hold ends it
                return
            lease = self.leases.pop(transfer_id, None)
            if lease is not None:
                self.ended.append((transfer_id, report))
        if lease is not None:
            self.server.withdraw(transfer_id)

    def take_ended(self) -> list[tuple[str, bool]]:
        """The leases ended since the last call (expired ones ended now): (id, reported)."""
        now = time.monotonic()
        with self.lock:
            expired = [
                tid for tid, lease in self.leases.items() if lease.deadline < now and not lease.held
            ]
        for transfer_id in expired:
            logger.info("KV lease of %s expired", transfer_id)
            self.end_lease(transfer_id, report=True)
        with self.lock:
            ended, self.ended = self.ended, []
        return ended

    def announce(
        self, handoff_id: str, message: dict[str, Any], transfer_id: str | None = None
    ) -> None:
        self.server.announce(handoff_id, message, transfer_id=transfer_id)

    def _on_transfer_done(self, transfer_id: str, ok: bool) -> None:
        """Server thread: the decode confirmed (ok) or a fetch or hold broke (not ok: the lease
        stays, no longer held, until confirmed, released or expired; the decode may retry)."""
        with self.lock:
            if not ok:
                self.new_failures["send"] = self.new_failures.get("send", 0) + 1
                lease = self.leases.get(transfer_id)
                if lease is not None:
                    lease.held = False
                return
            lease = self.leases.pop(transfer_id, None)
            if lease is None:
                return
            self.counters["kv_bytes_sent"] += lease.num_bytes
            self.counters["kv_blocks_sent"] += lease.num_blocks
            self.ended.append((transfer_id, True))
        self.wakeup()

    def _on_transfer_served(
        self, transfer_id: str, num_bytes: int | None, num_blocks: int | None
    ) -> None:
        """Server thread, right before a confirmation: count what the decode got, the bytes a
        fetch sent, or the blocks it read in place (all of them when it does not say) times a
        block's bytes."""
        with self.lock:
            lease = self.leases.get(transfer_id)
            if lease is None:
                return
            blocks = lease.num_blocks if num_blocks is None else num_blocks
            self.new_served["kv_blocks_served"] += blocks
            served = blocks * lease.block_bytes if num_bytes is None else num_bytes
            self.new_served["kv_bytes_served"] += served

    def _on_transfer_held(self, transfer_id: str) -> bool:
        """Server thread: a decode reads the blocks in place and asks that they stay until it
        confirms; False once the lease has ended (or before its request is done)."""
        with self.lock:
            lease = self.leases.get(transfer_id)
            if lease is None or not lease.transferable:
                return False
            lease.held = True
            return True

    # -- the decode side's requests -------------------------------------------------------------

    def release_remote(self, remote: KVTransferParams) -> None:
        """Tell a prefill worker its lease is done without loading it (from a thread)."""
        if self.releases is not None:
            self.releases.submit(self.release_now, remote)

    def release_now(self, remote: KVTransferParams) -> None:
        try:
            self.client.release(
                remote.remote_host,
                remote.remote_port,
                remote.remote_request_id,
                timeout=self.config.transfer_timeout_s,
            )
        except KVTransferError as exc:  # the lease expires on its own
            logger.warning("releasing %s failed: %s", remote.remote_request_id, exc)

    # -- the record of transfers ---------------------------------------------------------------

    def record_load(self, num_blocks: int, num_bytes: int | None, failure: str | None) -> None:
        with self.lock:
            if num_bytes is not None:
                self.counters["kv_bytes_received"] += num_bytes
                self.counters["kv_blocks_received"] += num_blocks
            if failure is not None:
                self.new_failures[failure] = self.new_failures.get(failure, 0) + 1

    def record_seconds(self, seconds: float) -> None:
        with self.lock:
            self.new_transfer_seconds.append(seconds)

    def _count_retry(self) -> None:
        """Client thread: a request on the KV port broke and is tried again."""
        with self.lock:
            self.new_failures["retried"] = self.new_failures.get("retried", 0) + 1

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics. "kv_transfer_seconds" (a list) and "kv_transfer_failures"
        (kind -> count: a load's failure kind, "send" for a fetch or hold that broke on the
        prefill side, "retried" for a broken connection tried again), "kv_bytes_served" and
        "kv_blocks_served" (what decodes got of this worker's confirmed transfers: a partial
        transfer's blocks only) hold only what happened since the previous call."""
        with self.lock:
            stats: dict[str, Any] = dict(self.counters)
            stats["kv_blocks_leased"] = sum(lease.num_blocks for lease in self.leases.values())
            stats["kv_transfer_seconds"], self.new_transfer_seconds = self.new_transfer_seconds, []
            stats["kv_transfer_failures"], self.new_failures = self.new_failures, {}
            stats.update(self.new_served)
            self.new_served = dict.fromkeys(self.new_served, 0)
        return stats

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.releases is not None:
            self.releases.shutdown(wait=False, cancel_futures=True)
        if self.client is not None:
            self.client.close()
