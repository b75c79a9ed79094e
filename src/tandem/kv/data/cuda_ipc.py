"""The cuda-ipc data plane: GPU-to-GPU KV copies between two workers on one host.

The source exports a handle to its whole KV cache once (`export`: it goes out in every prefill
answer's kv_ipc_handle, a few hundred bytes) and stages nothing: the destination reads the
cache in place, while the connector holds the source's lease. The destination maps a source's
cache once per source engine (into its own GPU's context, with peer access to the remote GPU);
start_read queues the read, and the engine thread launches it at the start of its next step
(`start_queued_reads`) on a copy stream that waits for the engine's queued work, with the
engine's stream waiting for the copy: one Triton kernel on the local GPU reads the remote blocks
over NVLink and writes the local ones:

    plane p = layer * 2 + (key | value), block pair i:
        local[p, local_block_ids[i]]  <-  remote[p, remote_block_ids[i]]      (one program each)

The source's GPU runs none of this. Without Triton the copy falls back to a torch gather and
scatter on the local GPU (slower: the bytes cross memory three times), as does a read of part of
the source's KV heads (tensor-parallel ranks of different sizes: `DataPlane.head_copy`). Both
workers must see the same GPUs under the same indices (a handle names the device by index). A
handle is plain data (msgpack: numbers, bytes and a fixed list of torch type names), never a
pickle: it arrives in a request's kv_transfer_params, and decoding it must not run code.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tandem.executor.input_staging import InputStaging
from tandem.kv.data.base import BlockSource, DataPlane, HeadCopy, ReadHandle
from tandem.kv.errors import KVTransferError

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

COPY_CHUNK = 16384  # elements per program (a whole 16-token block of 8 heads x 128)
COPY_WARPS = 8
STORAGE_DEVICE_ARG = 6  # in the arguments of torch's rebuild_cuda_tensor

if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(
        src_address,
        dst_address,
        src_ids_ptr,
        dst_ids_ptr,
        src_plane_stride,
        dst_plane_stride,
        block_elems,
        DTYPE: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        # The caches come as plain addresses: the remote one is another GPU's memory mapped
        # into ours, which Triton's pointer-argument check is not asked to judge.
        src_ptr = src_address.to(tl.pointer_type(DTYPE))
        dst_ptr = dst_address.to(tl.pointer_type(DTYPE))
        pair = tl.program_id(0)
        plane = tl.program_id(1).to(tl.int64)
        offsets = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
        mask = offsets < block_elems
        src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
        dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
        values = tl.load(
            src_ptr + plane * src_plane_stride + src_block * block_elems + offsets, mask=mask
        )
        tl.store(dst_ptr + plane * dst_plane_stride + dst_block * block_elems + offsets, values,
                 mask=mask)  # fmt: skip

    TRITON_DTYPES = {
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float32: tl.float32,
    }


def copy_blocks_kernel(
    remote_cache: torch.Tensor,
    remote_ids: torch.Tensor,
    local_cache: torch.Tensor,
    local_ids: torch.Tensor,
    chunk: int = COPY_CHUNK,
    num_warps: int = COPY_WARPS,
) -> None:
    """Launch the block copy on the current stream of local_cache's device. Caches:
    [layers, 2, num_blocks, *block], contiguous, the remote one mapped on the local device (as
    `open_handle` maps it); ids: int32 tensors on the local device."""
    num_planes = remote_cache.shape[0] * remote_cache.shape[1]
    block_elems = remote_cache[0, 0, 0].numel()
    grid = (len(local_ids), num_planes, triton.cdiv(block_elems, chunk))
    _copy_blocks_kernel[grid](
        remote_cache.data_ptr(), local_cache.data_ptr(), remote_ids, local_ids,
        remote_cache.shape[2] * block_elems, local_cache.shape[2] * block_elems, block_elems,
        DTYPE=TRITON_DTYPES[local_cache.dtype], CHUNK=chunk, num_warps=num_warps,
    )  # fmt: skip


# the types torch's rebuild_cuda_tensor takes as arguments, by the names handles carry them under
HANDLE_TYPES: dict[str, type] = {
    "Tensor": torch.Tensor,
    "UntypedStorage": torch.UntypedStorage,
    "TypedStorage": torch.TypedStorage,
}


class InvalidHandle(ValueError):
    """A CUDA IPC handle that is not one `export_handle` makes."""


def export_handle(kv_cache: torch.Tensor) -> str:
    rebuild, args = reduce_tensor(kv_cache)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError("CUDA IPC needs the KV cache on a CUDA device")
    return base64.b64encode(msgspec.msgpack.encode([_plain(arg) for arg in args])).decode("ascii")


def decode_handle(handle: str) -> list[Any]:
    """The arguments of rebuild_cuda_tensor that `handle` holds; InvalidHandle when it holds
    anything else."""
    try:
        fields = msgspec.msgpack.decode(base64.b64decode(handle, validate=True))
    except (ValueError, TypeError, msgspec.DecodeError) as exc:
        raise InvalidHandle(f"not a CUDA IPC handle: {exc}") from None
    if not isinstance(fields, list):
        raise InvalidHandle("not a CUDA IPC handle: not a list")
    return [_typed(field) for field in fields]


def open_handle(handle: str, local_device: torch.device) -> torch.Tensor:
    """Map the remote cache into local_device's context, so that kernels on that GPU read it
    (CUDA enables peer access to the remote GPU as it maps it). The tensor says local_device
    while its memory stays on the remote GPU. A mapping on the remote GPU's own context, as
    torch's rebuild makes by default, is not usable from the local GPU: a kernel there reading
    it faults."""
    args = decode_handle(handle)
    args[STORAGE_DEVICE_ARG] = torch.device(local_device).index
    return rebuild_cuda_tensor(*args)


def _plain(value: Any) -> Any:
    """One argument of rebuild_cuda_tensor as plain data: types and dtypes by name."""
    if isinstance(value, type):
        name = value.__name__
        if HANDLE_TYPES.get(name) is not value:
            raise ValueError(f"a CUDA IPC handle cannot carry the type {value!r}")
        return {"type": name}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, tuple):
        return {"tuple": list(value)}
    if value is None or isinstance(value, (bool, int, float, bytes, str)):
        return value
    raise ValueError(f"a CUDA IPC handle cannot carry {value!r}")


def _typed(value: Any) -> Any:
    """The inverse of `_plain`, for the names and shapes it writes only."""
    if not isinstance(value, dict):
        if value is None or isinstance(value, (bool, int, float, bytes, str)):
            return value
        raise InvalidHandle(f"a CUDA IPC handle holds no {type(value).__name__}")
    if len(value) != 1:
        raise InvalidHandle("not a CUDA IPC handle: a field of several keys")
    ((kind, content),) = value.items()
    if kind == "type" and content in HANDLE_TYPES:
        return HANDLE_TYPES[content]
    if kind == "dtype" and isinstance(getattr(torch, str(content), None), torch.dtype):
        return getattr(torch, content)
    if kind in ("size", "tuple") and isinstance(content, list):
        if not all(isinstance(item, int) and not isinstance(item, bool) for item in content):
            raise InvalidHandle(f"a CUDA IPC handle's {kind} holds more than integers")
        return torch.Size(content) if kind == "size" else tuple(content)
    raise InvalidHandle(f"a CUDA IPC handle holds no {kind} {content!r}")


class BlockCopier:
    """Queues copies of remote blocks into one local KV cache (all layers, keys and values) on a
    stream of the local GPU kept for them. The block ids go up through a kept pinned buffer:
    pinning fresh host memory for every copy cost more host time than the rest of the launch."""

    def __init__(self, local_cache: torch.Tensor) -> None:
        self.local_cache = local_cache  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.stream = torch.cuda.Stream(local_cache.device)
        self.id_stream = torch.cuda.Stream(local_cache.device)
        self.id_staging = InputStaging(local_cache.device)

    def launch(
        self,
        remote_cache: torch.Tensor,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        use_kernel: bool = True,
        after: torch.cuda.Event | None = None,
        heads: HeadCopy | None = None,
    ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue the copy without waiting for it, on the copier's stream: it starts after the
        work already queued on the local GPU's current stream (which may still use the local
        blocks). Returns two timing events: recorded as the copy is queued, and once it is done.
        use_kernel=False (or no Triton) gathers and scatters with torch instead, as does a copy
        of part of the KV heads (`heads`: the remote cache holds the source's heads).

        Without `after`, the current stream's later work waits for the copy. `after` (an event
        of the process that writes the remote blocks, opened on the local GPU): the copy also
        waits for it, and is timed from there; the current stream is then left free of it, so
        the caller makes the work that reads the blocks wait for `done` (work queued meanwhile,
        other requests' steps, does not wait for the remote process)."""
        local_cache, stream = self.local_cache, self.stream
        local_stream = torch.cuda.current_stream(local_cache.device)
        kernel = use_kernel and triton is not None and heads is None
        ids_dtype = torch.int32 if kernel else torch.int64
        queued, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(local_cache.device):
            # The ids go up on a stream of their own, which never waits on anything: behind an
            # earlier copy's wait, the next upload would make the engine thread wait for it.
            with torch.cuda.stream(self.id_stream):
                remote_ids, local_ids = self.id_staging.upload(
                    {ids_dtype: (remote_block_ids, local_block_ids)}
                )[ids_dtype]
            remote_ids.record_stream(stream)  # one storage holds both
            stream.wait_stream(self.id_stream)
            if after is not None:
                stream.wait_event(after)
            queued.record(stream)
            stream.wait_stream(local_stream)
            with torch.cuda.stream(stream):
                if kernel:
                    copy_blocks_kernel(remote_cache, remote_ids, local_cache, local_ids)
                elif heads is not None:
                    wanted = remote_cache.narrow(4, heads.source_start, heads.count)
                    local = local_cache.narrow(4, heads.local_start, heads.count)
                    local.index_copy_(2, local_ids, wanted.index_select(2, remote_ids))
                else:
                    planes = local_cache.shape[0] * local_cache.shape[1]
                    remote_planes = remote_cache.view(planes, remote_cache.shape[2], -1)
                    local_planes = local_cache.view(planes, local_cache.shape[2], -1)
                    local_planes[:, local_ids] = remote_planes[:, remote_ids]
            done.record(stream)
        if after is None:
            local_stream.wait_event(done)
        return queued, done


class CudaIpcDataPlane(DataPlane):
    reads_in_place = True
    export_fields = ("kv_ipc_handle",)

    def __init__(self, device: torch.device, *args, **kwargs) -> None:
        if device.type != "cuda":
            raise ValueError("the cuda-ipc KV transport needs --device cuda")
        super().__init__(device, *args, **kwargs)
        self.handle: str | None = None
        self.copier: BlockCopier | None = None
        self.remote_caches: dict[str, torch.Tensor] = {}  # a source cache's handle -> mapped
        self.lock = threading.Lock()
        self.queued: list[tuple[ReadHandle, torch.Tensor, list[int], list[int], HeadCopy | None]]
        self.queued = []

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().register_kv_cache(kv_cache)
        self.handle = export_handle(kv_cache)
        self.copier = BlockCopier(kv_cache)

    def export(self) -> dict[str, Any]:
        return {"kv_ipc_handle": self.handle}

    def start_read(
        self,
        source: BlockSource,
        local_block_ids: list[int],
        first_block: int,
        on_done: Callable[[ReadHandle], None] | None = None,
    ) -> ReadHandle:
        """Map the source's cache (on its first read) and queue the copy for the engine
        thread; raises KVTransferError when the source is not one this plane can read."""
        heads = self.head_copy(source)
        handle_text = source.exported.get("kv_ipc_handle")
        if not handle_text:
            raise KVTransferError("mismatch", "the prefill worker exported no CUDA IPC handle")
        if handle_text not in self.remote_caches:  # one per source cache (engine and rank)
            self.remote_caches[handle_text] = open_handle(handle_text, self.device)
        read = ReadHandle(on_done)
        remote_ids = source.block_ids[first_block:]
        remote_cache = self.remote_caches[handle_text]
        with self.lock:
            self.queued.append((read, remote_cache, remote_ids, local_block_ids, heads))
        self.wake_engine()
        return read

    def start_queued_reads(self) -> None:
        """Engine thread: launch the queued copies; each read is done once launched (the
        engine's later work waits for the copy), its wait_copied once the copy is."""
        with self.lock:
            queued, self.queued = self.queued, []
        if not queued:  # most steps: not even the slice below, which costs microseconds
            return
        for read, remote_cache, remote_ids, local_ids, heads in queued:
            try:
                queued_event, done = self.copier.launch(
                    remote_cache, remote_ids, local_ids, heads=heads
                )
            except Exception as exc:
                read.fail(exc)
                continue

            def copied(queued_event=queued_event, done=done) -> float:
                done.synchronize()
                return queued_event.elapsed_time(done) / 1e3

            block_bytes = remote_cache[:, :, 0].numel() * remote_cache.element_size()
            if heads is not None:
                block_bytes = block_bytes * heads.count // remote_cache.shape[4]
            read.finish(len(remote_ids) * block_bytes, copied, done.query)
