"""GPU-direct KV copies between two workers on one host, through CUDA IPC.

The prefill worker exports a handle to its whole KV cache once (it goes out with every prefill
answer, a few hundred bytes). The decode worker opens it once per prefill engine, which maps the
remote cache into its own address space, and then moves a request's blocks with one gather on the
remote GPU and one peer-to-peer copy over NVLink:

    remote kv_cache[:, :, remote_block_ids]  --index_select (remote GPU)-->  contiguous buffer
    contiguous buffer  --peer copy-->  local GPU  --index_copy_-->  local kv_cache[:, :, local_ids]

Both workers must see the same GPUs under the same indices (the same CUDA_VISIBLE_DEVICES), since a
handle names the device by its index. The TCP control channel of the connector still carries the
decode's confirmation, so leases and failures work as with the TCP transport.
"""

from __future__ import annotations

import base64
import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def export_handle(kv_cache: torch.Tensor) -> str:
    rebuild, args = reduce_tensor(kv_cache)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError("CUDA IPC needs the KV cache on a CUDA device")
    return base64.b64encode(pickle.dumps(args)).decode("ascii")


def open_handle(handle: str) -> torch.Tensor:
    return rebuild_cuda_tensor(*pickle.loads(base64.b64decode(handle)))


def copy_blocks(
    remote_cache: torch.Tensor,
    remote_block_ids: list[int],
    local_cache: torch.Tensor,
    local_block_ids: list[int],
    stream: torch.cuda.Stream,
) -> None:
    """Copy remote blocks into local blocks (all layers, keys and values) on `stream`, and wait
    for the copy to finish. Caches: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    remote_device, local_device = remote_cache.device, local_cache.device
    with torch.cuda.device(remote_device):
        remote_ids = torch.tensor(remote_block_ids, device=remote_device)
        gathered = remote_cache.index_select(2, remote_ids)
        torch.cuda.current_stream(remote_device).synchronize()
    with torch.cuda.stream(stream):
        local_ids = torch.tensor(local_block_ids, device=local_device)
        moved = gathered.to(local_device, non_blocking=True)
        local_cache.index_copy_(2, local_ids, moved)
    stream.synchronize()
