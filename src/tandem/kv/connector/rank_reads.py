"""Per-rank KV reads for the data planes that read the source's cache in place (nixl, mooncake,
cuda-ipc) under tensor parallelism: every rank registers its own KV-head shard with a plane of
its own, and each decode rank reads exactly the heads it holds from the prefill ranks that hold
them (tcp keeps rank 0's relay instead: kv/connector/ranks.py).

    prefill: once the caches are registered, every rank's export() is gathered on rank 0
             (`RankReads.exchange`), whose kv_transfer_params carry one per rank with the head
             range it holds (kv_rank_exports); nothing is staged, and rank 0 holds the lease
    decode:  rank 0's load waits for the announcement and holds the lease, then lists the read
             for the next step (`ForNextStep` -> KVConnectorMetadata.reads); every rank starts
             its reads there (`start_rank_reads`); each step while reads are in flight, every
             rank makes one all_reduce(MIN) of their states in metadata order (`RankReads.poll`):
             a read has ended once it ended on every rank, failed if it failed on any (the
             smallest failure kind), and only then does rank 0 report it and confirm the lease

Which source rank serves which heads (`plan_head_reads`): the first rank that holds each head
(replicated KV heads, fewer than ranks, as the relay picks), runs of heads merged. Equal head
ranges read whole blocks into the cache; the others read the source's whole blocks into staging
of its shape first (the planes' `DataPlane.head_copy`). A one-rank engine reads a tensor-parallel
prefill the same way, with no collective (`start_rank_reads` on its load thread).
Invariant: every rank starts the same reads and polls in the same steps (the metadata is the
same on every rank), so the collectives pair up; a read ends on a rank only once nothing writes
its local blocks and nothing reads the source's any more (`ReadHandle.copy_done`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from tandem.distributed.group import TensorParallelGroup
from tandem.kv.connector.base import KVConnectorWorker, RankKVTransfer
from tandem.kv.connector.metadata import RankReadSpec
from tandem.kv.connector.ranks import HeadRelay, RankLayout, ShardKVConnectorWorker, as_metadata
from tandem.kv.data import data_plane_class
from tandem.kv.data.base import BlockSource, DataPlane, ReadHandle
from tandem.kv.errors import TRANSFER_ERROR_KINDS, KVTransferError
from tandem.kv.params import KVTransferParams, RankExport

logger = logging.getLogger(__name__)

FAILURE_KINDS = (*TRANSFER_ERROR_KINDS, "error")  # "error": not the transfer's own failure
IN_FLIGHT, SUCCEEDED = 0, len(FAILURE_KINDS) + 1  # a failure is 1 + its index in FAILURE_KINDS


def load_failure(request_id: str, exc: BaseException) -> str:
    """The failure kind a load reports for `exc` (the transfer's kind, or "error" with its
    traceback logged: not the transfer's)."""
    if isinstance(exc, KVTransferError):
        logger.warning("KV load of %s failed: %s", request_id, exc)
        return exc.kind
    logger.error("KV load of %s failed", request_id, exc_info=exc)
    return "error"


@dataclass(frozen=True)
class SourceRank:
    heads: tuple[int, int]  # [start, stop) of the model's KV heads its cache holds
    exported: dict[str, Any]  # its plane's export()


def source_ranks(
    remote: KVTransferParams, num_kv_heads: int, export_fields: tuple[str, ...]
) -> list[SourceRank]:
    """The prefill's ranks (one holding every head where it exported no ranks); KVTransferError
    ("mismatch") for head ranges outside the model's."""
    if remote.kv_rank_exports is None:
        return [
            SourceRank((0, num_kv_heads), {name: getattr(remote, name) for name in export_fields})
        ]
    ranks = []
    for export in remote.kv_rank_exports:
        heads = (export.kv_head_start, export.kv_head_start + export.num_kv_heads)
        if heads[1] > num_kv_heads:
            raise KVTransferError(
                "mismatch", f"a prefill rank holds KV heads {heads}, the model has {num_kv_heads}"
            )
        ranks.append(SourceRank(heads, {name: getattr(export, name) for name in export_fields}))
    return ranks


def plan_head_reads(
    sources: list[tuple[int, int]], local: tuple[int, int]
) -> list[tuple[int, tuple[int, int]]]:
    """(source rank, [start, stop) of the heads to read from it) covering the local heads: each
    head from the first source rank holding it, consecutive heads of one rank in one read.

        sources [(0, 2), (2, 4)], local (1, 3)  ->  [(0, (1, 2)), (1, (2, 3))]
    """
    reads: list[tuple[int, tuple[int, int]]] = []
    for head in range(*local):
        holders = [rank for rank, (start, stop) in enumerate(sources) if start <= head < stop]
        if not holders:
            raise KVTransferError("mismatch", f"no rank of the prefill worker holds KV head {head}")
        if reads and reads[-1][0] == holders[0] and reads[-1][1][1] == head:
            reads[-1] = (holders[0], (reads[-1][1][0], head + 1))
        else:
            reads.append((holders[0], (head, head + 1)))
    return reads


def start_rank_reads(
    plane: DataPlane,
    remote: KVTransferParams,
    local_block_ids: list[int],
    first_block: int,
    num_kv_heads: int,
    on_done: Callable[[ReadHandle], None] | None = None,
) -> ReadHandle:
    """Read the local cache's heads (plane.kv_heads) of the prefill's blocks first_block.. into
    local_block_ids, one plane read per source rank that serves some of them. The handle ends
    once every part has ended (also when one failed or could not start: the others may still
    write the blocks), failed with the first part's failure, and moves the parts' bytes."""
    together = ReadsTogether(ReadHandle(on_done))
    failure: BaseException | None = None
    num_started = 0
    try:
        ranks = source_ranks(remote, num_kv_heads, plane.export_fields)
        for rank, heads in plan_head_reads([r.heads for r in ranks], plane.kv_heads):
            source = BlockSource(
                remote.remote_engine_id, remote.remote_host, remote.remote_port,
                remote.remote_request_id, remote.remote_block_ids, remote.kv_layout,
                (0, plane.kv_cache.shape[0]), ranks[rank].heads, ranks[rank].exported, heads,
            )  # fmt: skip
            plane.start_read(source, local_block_ids, first_block, together.part_ended)
            num_started += 1
    except Exception as exc:
        failure = exc
    together.all_started(num_started, failure)
    return together.combined


class ReadsTogether:
    """Ends `combined` once every part read has ended (parts may end before all have started)."""

    def __init__(self, combined: ReadHandle) -> None:
        self.combined = combined
        self.lock = threading.Lock()
        self.ended: list[ReadHandle] = []
        self.num_parts: int | None = None  # known once all have started
        self.failure: BaseException | None = None  # a part that could not start

    def part_ended(self, part: ReadHandle) -> None:
        with self.lock:
            self.ended.append(part)
            if len(self.ended) != self.num_parts:
                return
        self._end()

    def all_started(self, num_parts: int, failure: BaseException | None) -> None:
        with self.lock:
            self.num_parts, self.failure = num_parts, failure
            if len(self.ended) != num_parts:
                return
        self._end()

    def _end(self) -> None:
        parts, num_bytes = self.ended, 0
        for part in parts:
            try:
                num_bytes += part.result()
            except Exception as exc:
                self.failure = self.failure or exc
        if self.failure is not None:
            self.combined.fail(self.failure)
            return
        self.combined.finish(
            num_bytes,
            lambda: max((part.wait_copied() for part in parts), default=0.0),
            lambda: all(part.copy_done() for part in parts),
        )


@dataclass
class RankRead:
    request_id: str
    read: ReadHandle
    state: int = IN_FLIGHT  # this rank's, once its reads have ended


class RankReads:
    """This rank's part in the per-rank reads: its plane (its KV-head shard registered), the
    exchange of the ranks' exports, and its reads in flight."""

    def __init__(self, tp: TensorParallelGroup, layout: RankLayout, plane: DataPlane) -> None:
        self.tp = tp
        self.layout = layout
        self.plane = plane
        start = layout.starts[tp.rank]
        plane.kv_heads = (start, start + layout.count)
        self.in_flight: list[RankRead] = []

    def exchange(self) -> list[RankExport]:
        """Every rank, once its cache is registered: each rank's export with its head range
        (what rank 0 publishes; the other ranks drop it)."""
        exported = all_gather_bytes(
            self.tp, msgspec.msgpack.encode(self.plane.export()), self.plane.kv_cache.device
        )
        return [
            RankExport(start, self.layout.count, **msgspec.msgpack.decode(raw))
            for start, raw in zip(self.layout.starts, exported, strict=True)
        ]

    def start(self, specs: list[RankReadSpec]) -> None:
        """The step's new reads, in metadata order (engine thread, every rank)."""
        for spec in specs:
            read = start_rank_reads(
                self.plane,
                spec.remote,
                spec.local_block_ids,
                spec.first_block,
                self.layout.num_kv_heads,
            )
            self.in_flight.append(RankRead(spec.request_id, read))
        self.plane.start_queued_reads()

    def poll(self) -> list[tuple[str, str | None]]:
        """The reads that have now ended on every rank, with their failure kind (None: read);
        a collective while any read is in flight."""
        if not self.in_flight:
            return []
        states = [self._state(item) for item in self.in_flight]
        reduced = torch.tensor(states, dtype=torch.int32, device=self.plane.kv_cache.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.tp.process_group.allreduce([reduced], options).wait()
        polled, self.in_flight, ended = self.in_flight, [], []
        for item, state in zip(polled, reduced.tolist(), strict=True):
            if state == IN_FLIGHT:
                self.in_flight.append(item)
            else:
                failure = None if state == SUCCEEDED else FAILURE_KINDS[state - 1]
                ended.append((item.request_id, failure))
        return ended

    @staticmethod
    def _state(item: RankRead) -> int:
        if item.state == IN_FLIGHT and item.read.done() and item.read.copy_done():
            try:
                item.read.result()
                item.state = SUCCEEDED
            except Exception as exc:
                item.state = 1 + FAILURE_KINDS.index(load_failure(item.request_id, exc))
        return item.state


def all_gather_bytes(tp: TensorParallelGroup, payload: bytes, device: torch.device) -> list[bytes]:
    """Every rank's `payload`, in rank order, on every rank (two all-gathers: the lengths, then
    the bytes padded to the longest)."""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(tp.size)]
    tp.process_group.allgather([lengths], [length]).wait()
    sizes = [int(item.item()) for item in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    padded = padded.to(device)
    parts = [torch.empty_like(padded) for _ in range(tp.size)]
    tp.process_group.allgather([parts], [padded]).wait()
    return [bytes(part[:size].cpu().numpy()) for part, size in zip(parts, sizes, strict=True)]


class RankReadsConnectorWorker(KVConnectorWorker):
    """The worker side of a rank other than 0 whose engine's plane reads in place: its own
    plane holding its KV-head shard, and its part in the exchange of exports and in every read;
    it reports nothing (rank 0 reports for the engine)."""

    def __init__(self, rank_reads: RankReads) -> None:
        self.rank_reads = rank_reads

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.rank_reads.plane.register_kv_cache(kv_cache)
        self.rank_reads.exchange()  # rank 0 publishes what it gathers

    def start_load_kv(self, metadata) -> None:
        metadata = as_metadata(metadata)
        if metadata is None:
            return
        self.rank_reads.start(metadata.reads)
        self.rank_reads.poll()

    def shutdown(self) -> None:
        self.rank_reads.plane.close()


def other_rank_connector(
    tp: TensorParallelGroup, num_kv_heads: int, transfer: RankKVTransfer, device: torch.device
) -> KVConnectorWorker:
    """The worker side of rank tp.rank (not 0) of a PD engine: its part in rank 0's relay (tcp)
    or its own plane (one that reads in place)."""
    layout = RankLayout.of(num_kv_heads, tp.size)
    plane_class = data_plane_class(transfer.transport)
    if not plane_class.reads_in_place:
        return ShardKVConnectorWorker(HeadRelay(tp, layout))
    plane = plane_class(
        device, transfer.transfer_timeout_s, None, lambda: None, advertised_host=transfer.host
    )
    return RankReadsConnectorWorker(RankReads(tp, layout, plane))
