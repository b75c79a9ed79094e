"""The data plane interface: one per engine rank, it moves KV blocks and nothing else.

A data plane knows blocks, layers and KV-head ranges, never requests, leases or handoffs (the
connector maps those onto it; the control plane, kv/control, carries them between workers).

    source side     register_kv_cache(kv_cache); export() -> the fields a peer reaches this
                    cache with (they go out in kv_transfer_params);
                    stage(transfer_id, block_ids) -> StagedTransfer, save_layer(transfer_id, i)
                    after layer i is written, withdraw(transfer_id): for planes that copy the
                    blocks out (tcp); no-ops for planes that read the cache in place (cuda-ipc)
    destination     start_read(source, local_block_ids, first_block, on_done) -> ReadHandle:
                    read the source's blocks first_block.. into local_block_ids, asynchronously
                    (on_done(handle) once done, on the thread that ends it);
                    start_queued_reads() on the engine thread before each step's schedule
                    (a plane that queues reads for it wakes the engine: wake_engine)

Blocks line up one to one: remote block k holds the same tokens as the request's local block k.
`reads_in_place` planes read the source's cache while the read runs: the source must keep the
blocks (the connector holds its lease) until `ReadHandle.wait_copied()` returns.
KV heads are the model's indices: a source's cache holds `BlockSource.kv_heads`, the local one
`DataPlane.kv_heads` (a tensor-parallel rank's shard; all heads otherwise), and a read copies
`BlockSource.read_heads` of the source's into the same heads of the local cache (`head_copy`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BlockSource:
    """Where a read's blocks are: a peer's cache, and which part of it."""

    engine_id: str  # the source engine (a plane may keep what it maps per engine)
    host: str
    port: int  # the source's KV port (its control plane; tcp's byte stream runs on it)
    transfer_id: str  # what the source staged the blocks under
    block_ids: list[int]  # every block of the transfer, in token order
    layout: str  # kv_transfer_params' kv_layout: "{layers}x2x{kv_heads}x{head_dim}:{dtype}"
    layers: tuple[int, int]  # [start, stop) of the source's layers (today: all)
    kv_heads: tuple[int, int]  # [start, stop) of the model's KV heads the source's cache holds
    exported: dict[str, Any] = field(default_factory=dict)  # the source plane's export()
    read_heads: tuple[int, int] | None = None  # the heads to read (None: all of kv_heads)


@dataclass(frozen=True)
class HeadCopy:
    """A read of part of a source's KV heads: heads [source_start, source_start + count) of
    its cache's last-but-one dimension into [local_start, local_start + count) of the local
    cache's."""

    source_start: int
    local_start: int
    count: int


@dataclass
class StagedTransfer:
    """What a plane that copies blocks out serves for one transfer: one contiguous host tensor
    per layer, valid once wait_layer(i) returns (None: valid now)."""

    layers: list[torch.Tensor]
    wait_layer: Callable[[int], None] | None = None

    @property
    def num_bytes(self) -> int:
        return sum(layer.numel() * layer.element_size() for layer in self.layers)


class ReadHandle:
    """One read in flight. done() once the local blocks hold the source's bytes as far as the
    engine's next step sees them; result() -> the bytes moved, or raises what failed it
    (KVTransferError for the transfer's own failures)."""

    def __init__(self, on_done: Callable[[ReadHandle], None] | None = None) -> None:
        self.host_layers: list[torch.Tensor] | None = None  # a relayed read's bytes (tcp)
        self._future: Future[int] = Future()
        self._copied: Callable[[], float] = lambda: 0.0
        self._copy_done: Callable[[], bool] = lambda: True
        if on_done is not None:
            self._future.add_done_callback(lambda _: on_done(self))

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        return bool(wait([self._future], timeout).done)

    def result(self) -> int:
        return self._future.result()

    def wait_copied(self) -> float:
        """Block until nothing reads the source's blocks any more; the seconds the copy took
        on the device after it was queued (0.0 where done() already meant that)."""
        return self._copied()

    def copy_done(self) -> bool:
        """Whether wait_copied() would return at once (nothing reads the source's blocks)."""
        return self._copy_done()

    # the plane's side
    def finish(
        self,
        num_bytes: int,
        copied: Callable[[], float] | None = None,
        copy_done: Callable[[], bool] | None = None,
    ) -> None:
        if copied is not None:
            self._copied = copied
        if copy_done is not None:
            self._copy_done = copy_done
        self._future.set_result(num_bytes)

    def fail(self, exc: BaseException) -> None:
        self._future.set_exception(exc)


class DataPlane(abc.ABC):
    reads_in_place: ClassVar[bool] = False
    # the kv_transfer_params fields export() fills, which a destination's BlockSource carries
    export_fields: ClassVar[tuple[str, ...]] = ()
    # Whether save_layer copies each layer out while the later layers run (else the runner may
    # queue the whole forward pass first, one CUDA graph, and make every layer's call after it).
    saves_between_layers: ClassVar[bool] = False

    def __init__(
        self,
        device: torch.device,
        transfer_timeout_s: float,
        client: Any,
        wake_engine: Callable[[], None],
        advertised_host: str = "127.0.0.1",
    ) -> None:
        """client: the control plane's KVClient (None on a worker that reads no KV);
        wake_engine(): wakes an idle engine loop, for reads queued for its thread;
        advertised_host: the host peers reach this worker at (its KV server's)."""
        self.advertised_host = advertised_host
        self.device = device
        self.transfer_timeout_s = transfer_timeout_s
        self.client = client
        self.wake_engine = wake_engine
        self.kv_cache: torch.Tensor | None = None
        # the model's KV heads the local cache holds, [start, stop) (register_kv_cache: all of
        # its heads; a tensor-parallel rank's connector sets its shard's)
        self.kv_heads: tuple[int, int] | None = None
        # rank 0 of a tensor-parallel engine: its transfers carry every rank's KV heads,
        # gathered through this (tandem.kv.connector.ranks.HeadRelay); None: one rank
        self.relay: Any = None

    @property
    def num_kv_heads(self) -> int:
        """The KV heads a transfer of this plane carries: the model's."""
        if self.relay is not None:
            return self.relay.layout.num_kv_heads
        return self.kv_cache.shape[4]

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache[layer, 0 = key | 1 = value, block, offset, kv_head, head_dim]."""
        self.kv_cache = kv_cache
        if self.kv_heads is None:
            self.kv_heads = (0, kv_cache.shape[4])

    def export(self) -> dict[str, Any]:
        return {}

    def stage(self, transfer_id: str, block_ids: list[int]) -> StagedTransfer:
        return StagedTransfer([])

    def save_layer(self, transfer_id: str, layer_index: int) -> None:
        return None

    def withdraw(self, transfer_id: str) -> None:
        return None

    @abc.abstractmethod
    def start_read(
        self,
        source: BlockSource,
        local_block_ids: list[int],
        first_block: int,
        on_done: Callable[[ReadHandle], None] | None = None,
    ) -> ReadHandle: ...

    def start_queued_reads(self) -> None:
        """Engine thread, before each step's schedule: start what must start there."""
        return None

    def close(self) -> None:
        return None

    def head_copy(self, source: BlockSource) -> HeadCopy | None:
        """What part of the source's KV heads a read copies, None when it copies whole blocks
        (the source's cache and the local one hold the same heads, and all are read);
        KVTransferError ("mismatch") when the heads to read are not in both caches."""
        from tandem.kv.errors import KVTransferError

        num_layers = self.kv_cache.shape[0]
        if source.layers != (0, num_layers):
            raise KVTransferError(
                "mismatch", f"layers {source.layers} of the source, this worker has {num_layers}"
            )
        read = source.read_heads or source.kv_heads
        held, local = source.kv_heads, self.kv_heads
        if not (
            held[0] <= read[0] < read[1] <= held[1] and local[0] <= read[0] < read[1] <= local[1]
        ):
            raise KVTransferError(
                "mismatch",
                f"KV heads {read} to read, of the source's {held}, into this cache's {local}",
            )
        if read == held == local:
            return None
        return HeadCopy(read[0] - held[0], read[0] - local[0], read[1] - read[0])

    def check_whole(self, source: BlockSource) -> None:
        """A plane that reads whole transfers (tcp): every layer and every KV head."""
        from tandem.kv.errors import KVTransferError

        num_layers, num_kv_heads = self.kv_cache.shape[0], self.num_kv_heads
        if source.layers != (0, num_layers) or source.kv_heads != (0, num_kv_heads):
            raise KVTransferError(
                "mismatch",
                f"layers {source.layers} and KV heads {source.kv_heads} of the source, this "
                f"worker reads all {num_layers} layers and {num_kv_heads} KV heads",
            )
