"""What the nixl and mooncake data planes share: the KV cache registered with a transfer library,
read in place by the destination with one-sided READs.

Source side: register_kv_cache registers the whole cache with the library (DRAM on CPU, VRAM on
CUDA) and export() hands out its `MemoryHandle` (kv_transfer_params' kv_memory_handle: the
library's address of this worker, the cache's base address and its number of blocks), a few
hundred bytes of msgpack that decoding never runs. Nothing is staged: the connector holds the
source's lease while the destination reads, and confirms once the read is done.
Destination side: start_read turns the read into regions (local address, remote address,
length), one per layer, key or value, and run of consecutive blocks on both sides, and a read
thread hands them to the library (`_read_regions`, the plane's) and waits for them, bounded by
the transfer timeout. A read of part of the source's KV heads (tensor-parallel ranks of
different sizes, `DataPlane.head_copy`) reads the source's whole blocks into a staging tensor of
the source's shape, registered for that read only, and copies the heads it wants into the local
blocks before it ends. Invariant: a read's handle ends only once the library is done with the
local blocks (done, failed, or given up and cancelled) and any staging copy is done, so they may
be freed next; every library failure is a KVTransferError.

Cache layout: [layers, 2, num_blocks, block_size, kv_heads, head_dim], contiguous, so block b of
plane p = layer * 2 + (key | value) starts at base + (p * num_blocks + b) * block_bytes.
"""

from __future__ import annotations

import abc
import base64
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import torch

from tandem.kv.data.base import BlockSource, DataPlane, HeadCopy, ReadHandle
from tandem.kv.errors import KVTransferError

READ_THREADS = 4
POLL_INTERVAL_S = 0.0005


class MemoryHandle(msgspec.Struct, frozen=True):
    peer: str  # how the library reaches the source: a NIXL agent's name, a Mooncake session
    address: int  # the registered cache's base address on the source
    num_blocks: int  # blocks per plane in the source's cache
    device_id: int = 0  # the source's GPU index (0 for host memory)
    metadata: bytes = b""  # what the library needs to reach the peer (NIXL's agent metadata)


def encode_handle(handle: MemoryHandle) -> str:
    return base64.b64encode(msgspec.msgpack.encode(handle)).decode("ascii")


def decode_handle(text: str | None) -> MemoryHandle:
    """The handle a source exported; KVTransferError ("mismatch") for anything else."""
    if not text:
        raise KVTransferError("mismatch", "the prefill worker exported no kv_memory_handle")
    try:
        return msgspec.msgpack.decode(base64.b64decode(text, validate=True), type=MemoryHandle)
    except (ValueError, TypeError, msgspec.DecodeError) as exc:
        raise KVTransferError("mismatch", f"not a kv_memory_handle: {exc}") from None


def block_regions(
    local_base: int,
    local_num_blocks: int,
    local_block_ids: list[int],
    remote_base: int,
    remote_num_blocks: int,
    remote_block_ids: list[int],
    num_planes: int,
    block_bytes: int,
) -> np.ndarray:
    """[n, 3] uint64 rows (local address, remote address, length): every plane's blocks, pair
    i copying remote_block_ids[i] into local_block_ids[i], runs consecutive (ascending) on both
    sides merged into one row: the block pools hand out every allocation in ascending ids."""
    local_ids = np.asarray(local_block_ids, dtype=np.int64)
    remote_ids = np.asarray(remote_block_ids, dtype=np.int64)
    breaks = (np.diff(local_ids) != 1) | (np.diff(remote_ids) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(starts, len(local_ids))) * block_bytes
    planes = np.arange(num_planes, dtype=np.int64)[:, None]
    local = local_base + (planes * local_num_blocks + local_ids[starts]) * block_bytes
    remote = remote_base + (planes * remote_num_blocks + remote_ids[starts]) * block_bytes
    rows = np.empty((local.size, 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1] = local.ravel(), remote.ravel()
    rows[:, 2] = np.broadcast_to(lengths, local.shape).ravel()
    return rows


class RegisteredMemoryPlane(DataPlane):
    reads_in_place = True
    export_fields = ("kv_memory_handle",)
    library = ""  # the plane's name in errors

    def __init__(self, device: torch.device, *args, **kwargs) -> None:
        super().__init__(device, *args, **kwargs)
        self.handle: str | None = None
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix=f"kv-{self.library}")

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError(f"the {self.library} KV transport needs a contiguous KV cache")
        super().register_kv_cache(kv_cache)
        peer, metadata = self._register(kv_cache)
        device_id = kv_cache.device.index or 0
        self.handle = encode_handle(
            MemoryHandle(peer, kv_cache.data_ptr(), kv_cache.shape[2], device_id, metadata)
        )

    def export(self) -> dict[str, Any]:
        return {"kv_memory_handle": self.handle}

    def start_read(
        self,
        source: BlockSource,
        local_block_ids: list[int],
        first_block: int,
        on_done: Callable[[ReadHandle], None] | None = None,
    ) -> ReadHandle:
        heads = self.head_copy(source)
        remote = decode_handle(source.exported.get("kv_memory_handle"))
        remote_ids = source.block_ids[first_block:]
        if len(remote_ids) != len(local_block_ids):
            raise KVTransferError(
                "mismatch", f"{len(remote_ids)} source blocks for {len(local_block_ids)} local"
            )
        target, target_ids = self.kv_cache, local_block_ids
        if heads is not None:  # the source's whole blocks, staged in the source's shape
            cache = self.kv_cache
            num_source_heads = source.kv_heads[1] - source.kv_heads[0]
            # [layers, 2, blocks read, block_size, the source's heads, head_dim]
            shape = (*cache.shape[:2], len(remote_ids), cache.shape[3], num_source_heads)
            target = torch.empty((*shape, cache.shape[5]), dtype=cache.dtype, device=cache.device)
            target_ids = list(range(len(remote_ids)))
        block_bytes = target[0, 0, 0].numel() * target.element_size()
        regions = block_regions(
            target.data_ptr(), target.shape[2], target_ids,
            remote.address, remote.num_blocks, remote_ids,
            target.shape[0] * target.shape[1], block_bytes,
        )  # fmt: skip
        read = ReadHandle(on_done)
        staging = None if heads is None else (target, heads, local_block_ids)
        self.readers.submit(self._read, read, source, remote, regions, staging)
        return read

    def _read(
        self,
        read: ReadHandle,
        source: BlockSource,
        remote: MemoryHandle,
        regions: np.ndarray,
        staging: tuple[torch.Tensor, HeadCopy, list[int]] | None,
    ) -> None:
        try:
            if staging is None:
                self._read_regions(source, remote, regions, self.transfer_timeout_s)
            else:
                self._read_staged(source, remote, regions, *staging)
        except KVTransferError as exc:
            read.fail(exc)
            return
        except Exception as exc:  # the library's own errors
            read.fail(KVTransferError("connection", f"{self.library} read failed: {exc!r}"))
            return
        read.finish(int(regions[:, 2].sum()))

    def _read_staged(
        self,
        source: BlockSource,
        remote: MemoryHandle,
        regions: np.ndarray,
        staging: torch.Tensor,
        heads: HeadCopy,
        local_block_ids: list[int],
    ) -> None:
        """Read into `staging` (registered for this read), then copy its heads `heads` into
        the local blocks (on CUDA on a stream of its own, waited for)."""
        registration = self._register_staging(staging)
        try:
            self._read_regions(source, remote, regions, self.transfer_timeout_s)
        finally:
            self._deregister_staging(staging, registration)
        cache = self.kv_cache
        targets = torch.tensor(local_block_ids, dtype=torch.long, device=cache.device)
        wanted = staging.narrow(4, heads.source_start, heads.count)
        local = cache.narrow(4, heads.local_start, heads.count)
        if cache.device.type != "cuda":
            local.index_copy_(2, targets, wanted)
            return
        stream = torch.cuda.Stream(cache.device)
        with torch.cuda.stream(stream):
            local.index_copy_(2, targets, wanted)
        stream.synchronize()

    @abc.abstractmethod
    def _register(self, kv_cache: torch.Tensor) -> tuple[str, bytes]:
        """Register the cache with the library: (MemoryHandle.peer, MemoryHandle.metadata)."""

    @abc.abstractmethod
    def _register_staging(self, staging: torch.Tensor) -> Any:
        """Register a read's staging tensor with the library; what deregistering it takes."""

    @abc.abstractmethod
    def _deregister_staging(self, staging: torch.Tensor, registration: Any) -> None:
        """Undo `_register_staging` (the library no longer uses the tensor)."""

    @abc.abstractmethod
    def _read_regions(
        self, source: BlockSource, remote: MemoryHandle, regions: np.ndarray, timeout: float
    ) -> None:
        """Read every region and return once done; raise when it failed or passed `timeout`,
        and only once the library no longer writes the local blocks."""

    def close(self) -> None:
        self.readers.shutdown(wait=False, cancel_futures=True)


def missing_library(transport: str, package: str) -> ImportError:
    """The one-line error of a plane whose library is not installed."""
    return ImportError(
        f"the {transport} KV transport needs {package}: pip install 'tandem[{transport}]'"
    )
