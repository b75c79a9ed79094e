"""The tcp data plane: KV blocks staged through host memory and streamed over the KV port.

Source side: stage() allocates one host tensor per layer (pinned on CUDA); save_layer(i) gathers
layer i's blocks into it on a side stream as soon as the layer is written, and the KV server
(kv/control) sends layer i once its copy is done, so the bytes leave while later layers run.
Destination side: start_read() runs a FETCH on a read thread (the control plane's client)
for the blocks from first_block on (the local prefix cache holds those before): only they
cross the wire, each layer lands in host staging of that many blocks and is scattered into the
local blocks as it arrives (host to device on a side stream); the fetch's CONFIRM ends the
source's lease. Any two hosts, no library. On rank 0 of a tensor-parallel engine (`relay`), a
staged layer gathers every rank's KV heads, and a read stays in host staging (the blocks read
only) for the ranks to install (kv/connector/ranks.py).
Invariant: a read's handle ends only after every copy into the local blocks is done, also on
failure (the blocks may be freed next).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from tandem.kv.data.base import BlockSource, DataPlane, ReadHandle, StagedTransfer

READ_THREADS = 4


class TcpDataPlane(DataPlane):
    saves_between_layers = True

    def __init__(self, device: torch.device, *args, **kwargs) -> None:
        super().__init__(device, *args, **kwargs)
        self.pinned = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.pinned else None
        self.lock = threading.Lock()
        self.staged: dict[str, tuple[list[int], StagedTransfer, list]] = {}  # + CUDA events
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-tcp-read")

    def _host_layers(self, num_blocks: int) -> list[torch.Tensor]:
        block_size, head_dim = self.kv_cache.shape[3], self.kv_cache.shape[5]
        shape = (2, num_blocks, block_size, self.num_kv_heads, head_dim)
        return [
            torch.empty(shape, dtype=self.kv_cache.dtype, pin_memory=self.pinned)
            for _ in range(self.kv_cache.shape[0])
        ]

    # -- source side -------------------------------------------------------------------------

    def stage(self, transfer_id: str, block_ids: list[int]) -> StagedTransfer:
        layers = self._host_layers(len(block_ids))
        events = [torch.cuda.Event() for _ in layers] if self.pinned else []
        wait_layer = (lambda i: events[i].synchronize()) if self.pinned else None
        staged = StagedTransfer(layers, wait_layer)
        with self.lock:
            self.staged[transfer_id] = (block_ids, staged, events)
        return staged

    def save_layer(self, transfer_id: str, layer_index: int) -> None:
        with self.lock:
            entry = self.staged.get(transfer_id)
        if entry is None:
            return
        block_ids, staged, events = entry
        source = self.kv_cache[layer_index]  # [2, num_blocks, block_size, heads, dim]
        if self.relay is not None:  # every rank's heads, gathered here (a collective)
            index = torch.tensor(block_ids, device=self.device)
            gathered = self.relay.gather_heads(source.index_select(1, index))
            staged.layers[layer_index].copy_(gathered)
            return
        if self.copy_stream is None:
            index = torch.tensor(block_ids, device=self.device)
            torch.index_select(source, 1, index, out=staged.layers[layer_index])
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            # made on the copy stream, so its memory is not handed out again before the
            # gather below has read it (the engine's stream runs ahead of this one)
            index = torch.tensor(block_ids, device=self.device)
            gathered = source.index_select(1, index)
            staged.layers[layer_index].copy_(gathered, non_blocking=True)
            events[layer_index].record(self.copy_stream)

    def withdraw(self, transfer_id: str) -> None:
        with self.lock:
            self.staged.pop(transfer_id, None)

    # -- destination side ----------------------------------------------------------------------

    def start_read(
        self,
        source: BlockSource,
        local_block_ids: list[int],
        first_block: int,
        on_done: Callable[[ReadHandle], None] | None = None,
    ) -> ReadHandle:
        handle = ReadHandle(on_done)
        self.readers.submit(self._read, handle, source, local_block_ids, first_block)
        return handle

    def _read(
        self, handle: ReadHandle, source: BlockSource, local_block_ids: list[int], first_block: int
    ) -> None:
        try:
            self.check_whole(source)
            staging = self._host_layers(len(source.block_ids) - first_block)
            targets = torch.tensor(local_block_ids, dtype=torch.long, device=self.device)
            stream = torch.cuda.Stream(self.device) if self.pinned else None

            def on_layer(layer_index: int) -> None:
                received = staging[layer_index]
                if self.relay is not None:  # every rank installs its heads in a later step
                    return
                if stream is None:
                    self.kv_cache[layer_index].index_copy_(1, targets, received)
                    return
                with torch.cuda.stream(stream):
                    on_device = received.to(self.device, non_blocking=True)
                    self.kv_cache[layer_index].index_copy_(1, targets, on_device)

            try:
                self.client.fetch(
                    source.host,
                    source.port,
                    source.transfer_id,
                    staging,
                    timeout=self.transfer_timeout_s,
                    on_layer=on_layer,
                    first_block=first_block,
                )
            finally:  # also on failure: no copy may still write into the blocks
                if stream is not None:
                    stream.synchronize()
        except BaseException as exc:
            handle.fail(exc)
            return
        if self.relay is not None:
            handle.host_layers = staging
        handle.finish(StagedTransfer(staging).num_bytes)

    def close(self) -> None:
        self.readers.shutdown(wait=False, cancel_futures=True)
