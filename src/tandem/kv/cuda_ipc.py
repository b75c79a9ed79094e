"""GPU-direct KV copies between two workers on one host, through CUDA IPC.

The prefill worker exports a handle to its whole KV cache once (it goes out with every prefill
answer, a few hundred bytes). The decode worker opens it once per prefill engine, which maps the
remote cache into its own address space (on the remote GPU's context), and then moves a request's
blocks with one Triton kernel launched on the remote GPU, which reads the remote blocks there and
writes them over NVLink straight into the local blocks (peer access from the remote GPU to ours):

    plane p = layer * 2 + (key | value), block pair i:
        local[p, local_block_ids[i]]  <-  remote[p, remote_block_ids[i]]      (one program each)

Without Triton the copy falls back to a gather on the remote GPU and one peer copy (slower: the
bytes cross memory three times).

Both workers must see the same GPUs under the same indices (the same CUDA_VISIBLE_DEVICES), since a
handle names the device by its index. The TCP control channel of the connector still carries the
decode's confirmation, so leases and failures work as with the TCP transport.
"""

from __future__ import annotations

import base64
import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tandem.engine.input_staging import InputStaging

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

COPY_CHUNK = 16384  # elements per program (a whole 16-token block of 8 heads x 128)
COPY_WARPS = 8

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
        # The caches come as plain addresses: the local one belongs to another GPU, which
        # Triton's pointer-argument check refuses, while the kernel writes it fine over NVLink.
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
    """Launch the block copy on the current stream of remote_cache's device. Caches:
    [layers, 2, num_blocks, *block], contiguous; ids: integer tensors on remote_cache's device."""
    num_planes = remote_cache.shape[0] * remote_cache.shape[1]
    block_elems = remote_cache[0, 0, 0].numel()
    grid = (len(local_ids), num_planes, triton.cdiv(block_elems, chunk))
    _copy_blocks_kernel[grid](
        remote_cache.data_ptr(), local_cache.data_ptr(), remote_ids, local_ids,
        remote_cache.shape[2] * block_elems, local_cache.shape[2] * block_elems, block_elems,
        DTYPE=TRITON_DTYPES[local_cache.dtype], CHUNK=chunk, num_warps=num_warps,
    )  # fmt: skip


def export_handle(kv_cache: torch.Tensor) -> str:
    rebuild, args = reduce_tensor(kv_cache)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError("CUDA IPC needs the KV cache on a CUDA device")
    return base64.b64encode(pickle.dumps(args)).decode("ascii")


def open_handle(handle: str, local_device: torch.device) -> torch.Tensor:
    """Map the remote cache, after enabling peer access between its GPU and ours both ways
    (torch enables it on the first copy between two devices)."""
    args = pickle.loads(base64.b64decode(handle))
    remote_device = torch.device(args[6])
    if remote_device != local_device:
        torch.zeros(1, device=remote_device).to(local_device)
        torch.zeros(1, device=local_device).to(remote_device)
    return rebuild_cuda_tensor(*args)


class BlockCopier:
    """Queues copies of remote blocks into one local KV cache (all layers, keys and values).
    The block ids go up through a pinned buffer kept per remote GPU: pinning fresh host memory
    for every copy cost more host time than the rest of the launch."""

    def __init__(self, local_cache: torch.Tensor) -> None:
        self.local_cache = local_cache  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.id_staging: dict[torch.device, InputStaging] = {}

    @property
    def queues_apart(self) -> bool:
        """Whether a copy that waits on another process's event (`launch(after=...)`) leaves
        the local stream free meanwhile: with the kernel, not with the fallback's peer copy."""
        return triton is not None

    def launch(
        self,
        remote_cache: torch.Tensor,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        use_kernel: bool = True,
        after: torch.cuda.Event | None = None,
    ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue the copy without waiting for it: it starts after the work already queued on
        the local GPU's current stream (which may still use the local blocks), and that
        stream's later work waits for it. Returns two timing events on the remote GPU:
        recorded as the copy is queued, and once it is done. use_kernel=False (or no Triton)
        gathers on the remote GPU and makes one peer copy instead.

        `after` (an event of the remote GPU, from the process that writes the remote blocks):
        the copy also waits for it, and is timed from there; with the kernel, the local stream
        is then left free of it, so the caller makes the work that reads the blocks wait for
        `done` (work queued meanwhile does not wait for the remote GPU)."""
        local_cache = self.local_cache
        local_device, remote_device = local_cache.device, remote_cache.device
        local_stream = torch.cuda.current_stream(local_device)
        ready = torch.cuda.Event()
        ready.record(local_stream)
        queued, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(remote_device):
            remote_stream = torch.cuda.current_stream(remote_device)
            if use_kernel and triton is not None:
                # The ids go up ahead of the wait below, so the next upload never waits on it.
                staging = self.id_staging.get(remote_device)
                if staging is None:
                    staging = self.id_staging[remote_device] = InputStaging(remote_device)
                remote_ids, local_ids = staging.upload(
                    {torch.int32: (remote_block_ids, local_block_ids)}
                )[torch.int32]
                if after is not None:
                    remote_stream.wait_event(after)
                queued.record(remote_stream)
                remote_stream.wait_event(ready)
                copy_blocks_kernel(remote_cache, remote_ids, local_cache, local_ids)
                done.record(remote_stream)
                if after is None:
                    local_stream.wait_event(done)
                return queued, done
            if after is not None:
                remote_stream.wait_event(after)
            queued.record(remote_stream)
            remote_stream.wait_event(ready)
            planes = remote_cache.shape[0] * remote_cache.shape[1]
            remote_ids = torch.tensor(remote_block_ids, device=remote_device)
            gathered = remote_cache.view(planes, remote_cache.shape[2], -1)[:, remote_ids]
            local_stream.wait_stream(remote_stream)
        with torch.cuda.stream(local_stream):
            local_ids = torch.tensor(local_block_ids, device=local_device)
            moved = gathered.to(local_device, non_blocking=True)
            local_cache.view(planes, local_cache.shape[2], -1)[:, local_ids] = moved
        remote_stream.wait_stream(local_stream)
        done.record(remote_stream)  # on the remote GPU, as `queued`, so the two time the copy
        return queued, done
