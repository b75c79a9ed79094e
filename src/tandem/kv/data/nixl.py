"""The nixl data plane: KV blocks read in place over NIXL (UCX: RDMA, NVLink, or TCP).

Each worker makes two NIXL agents with the UCX backend and registers its whole KV cache with
both (VRAM on CUDA, DRAM on CPU): the serving agent, with NIXL's progress thread, which peers
read from (over UCX's TCP a read needs the source to progress), and the reading agent, without
one: its reads progress in their own poll (a progress thread spinning beside them made a read
between two GPUs 1.3 to 1.7 times slower). The MemoryHandle carries the serving agent's name and
metadata (a few hundred bytes), so a destination adds each source agent once, on its first read
from it, with no side channel. A read is one NIXL READ of every region (kv/data/registered.py),
polled with check_xfer_state until done, failed or past the transfer timeout (then released,
which cancels it). Each agent's UCX backend runs `VRAM_UCX_WORKERS` workers for a cache on a
GPU. UCX picks its transports and devices from its own environment: UCX_TLS (e.g. `tcp`, or
`rc,cuda_copy,cuda_ipc`), UCX_NET_DEVICES (e.g. `mlx5_0:1` or `eth0`); docs/multi-host.md.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np
import torch

from tandem.kv.data.base import BlockSource
from tandem.kv.data.registered import (
    POLL_INTERVAL_S,
    MemoryHandle,
    RegisteredMemoryPlane,
    missing_library,
)
from tandem.kv.errors import KVTransferError

try:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:
    try:  # the wheel of one CUDA major version, without the `nixl` meta package
        from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError:
        raise missing_library("nixl", "NIXL") from None

logger = logging.getLogger(__name__)

# UCX workers of the agent's backend (NIXL's `num_workers`, 1 by default) where the cache is in
# VRAM: between two H200s one NIXL read of 56 regions of 20 MB took 4.6 ms with one, 3.8 ms with
# four. Over TCP on the 2-core CPU machine four were no faster (1.62 s against 1.45 s for 1.1 GB),
# so host memory keeps one (docs/benchmarks.md).
VRAM_UCX_WORKERS = 4


def new_agent(num_workers: int, progress_thread: bool) -> nixl_agent:
    config = nixl_agent_config(
        enable_prog_thread=progress_thread,
        backends=[],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl_agent(f"tandem-{uuid.uuid4().hex}", config)
    agent.create_backend("UCX", {"num_workers": str(num_workers)})
    return agent


class NixlDataPlane(RegisteredMemoryPlane):
    library = "nixl"

    def __init__(self, device: torch.device, *args, **kwargs) -> None:
        super().__init__(device, *args, **kwargs)
        self.memory_type = "VRAM" if device.type == "cuda" else "DRAM"
        workers = VRAM_UCX_WORKERS if device.type == "cuda" else 1
        self.serving_agent = new_agent(workers, progress_thread=True)
        self.reading_agent = new_agent(workers, progress_thread=False)
        self.lock = threading.Lock()
        self.remote_agents: set[str] = set()

    def _register(self, kv_cache: torch.Tensor) -> tuple[str, bytes]:
        self.serving_agent.register_memory(kv_cache)
        self.reading_agent.register_memory(kv_cache)
        return self.serving_agent.name, self.serving_agent.get_agent_metadata()

    def _register_staging(self, staging: torch.Tensor):
        return self.reading_agent.register_memory(staging)

    def _deregister_staging(self, staging: torch.Tensor, registration) -> None:
        self.reading_agent.deregister_memory(registration)

    def _read_regions(
        self, source: BlockSource, remote: MemoryHandle, regions: np.ndarray, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        self._add_peer(remote)
        local_device = np.full(len(regions), self.kv_cache.device.index or 0, dtype=np.uint64)
        remote_device = np.full(len(regions), remote.device_id, dtype=np.uint64)
        local = np.column_stack([regions[:, 0], regions[:, 2], local_device])
        far = np.column_stack([regions[:, 1], regions[:, 2], remote_device])
        agent = self.reading_agent
        local_descs = agent.get_xfer_descs(local, self.memory_type)
        remote_descs = agent.get_xfer_descs(far, self.memory_type)
        transfer = agent.initialize_xfer("READ", local_descs, remote_descs, remote.peer)
        try:
            state = agent.transfer(transfer)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(POLL_INTERVAL_S)
                state = agent.check_xfer_state(transfer)
        finally:
            agent.release_xfer_handle(transfer)  # cancels a read still in flight
        if state == "PROC":
            raise KVTransferError("timeout", f"the nixl read from {source.host} passed {timeout} s")
        if state != "DONE":
            raise KVTransferError("connection", f"the nixl read from {source.host} failed")

    def _add_peer(self, remote: MemoryHandle) -> None:
        """Add the source's agent on its first read (a source agent's name is unique to it)."""
        with self.lock:
            if remote.peer in self.remote_agents:
                return
            try:
                self.reading_agent.add_remote_agent(remote.metadata)
            except Exception as exc:
                raise KVTransferError("mismatch", f"unusable NIXL agent metadata: {exc!r}") from exc
            self.remote_agents.add(remote.peer)

    def close(self) -> None:
        super().close()
        with self.lock:
            for name in self.remote_agents:
                try:
                    self.reading_agent.remove_remote_agent(name)
                except Exception as exc:
                    logger.debug("removing NIXL agent %s: %r", name, exc)
            self.remote_agents.clear()
