"""The mooncake data plane: KV blocks read in place over Mooncake's TransferEngine.

Each worker starts one TransferEngine with P2P handshake metadata (no metadata service: a peer
is reached at its session, "host:rpc port") and registers its whole KV cache with it; its
MemoryHandle carries that session. A read is synchronous batches of READs of at most
MAX_BATCH regions each (kv/data/registered.py) on a read thread; Mooncake's own timeout bounds it
(MC_TRANSFER_TIMEOUT, set here to the transfer timeout unless given), and a batch ends only
once Mooncake no longer writes its local blocks.

Environment: TANDEM_MOONCAKE_PROTOCOL (tcp, the default, or rdma where a NIC exists),
TANDEM_MOONCAKE_DEVICES (the RDMA devices, e.g. `mlx5_0,mlx5_1`; empty: all found); Mooncake's
own MC_* variables pass through (docs/multi-host.md). The non-CUDA wheel registers host memory
only: on GPUs use the CUDA wheel (`mooncake-transfer-engine`).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from tandem.kv.data.base import BlockSource
from tandem.kv.data.registered import (
    MemoryHandle,
    RegisteredMemoryPlane,
    missing_library,
)
from tandem.kv.errors import KVTransferError

MAX_BATCH = 256  # regions per batch: Mooncake's TCP transport fails on batches of thousands

try:
    from mooncake.engine import TransferEngine
except ImportError as exc:
    raise missing_library("mooncake", f"Mooncake's transfer engine ({exc})") from None


class MooncakeDataPlane(RegisteredMemoryPlane):
    library = "mooncake"

    def __init__(self, device: torch.device, *args, **kwargs) -> None:
        super().__init__(device, *args, **kwargs)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(math.ceil(self.transfer_timeout_s)))
        protocol = os.environ.get("TANDEM_MOONCAKE_PROTOCOL", "tcp")
        devices = os.environ.get("TANDEM_MOONCAKE_DEVICES", "")
        self.engine = TransferEngine()
        advertised_host = self.advertised_host
        if self.engine.initialize(advertised_host, "P2PHANDSHAKE", protocol, devices) != 0:
            raise RuntimeError(
                f"Mooncake's transfer engine did not start on {advertised_host} over {protocol}"
            )
        self.session = f"{advertised_host}:{self.engine.get_rpc_port()}"

    def _register(self, kv_cache: torch.Tensor) -> tuple[str, bytes]:
        num_bytes = kv_cache.numel() * kv_cache.element_size()
        if self.engine.register_memory(kv_cache.data_ptr(), num_bytes) != 0:
            raise RuntimeError("Mooncake could not register the KV cache")
        return self.session, b""

    def _register_staging(self, staging: torch.Tensor) -> None:
        num_bytes = staging.numel() * staging.element_size()
        if self.engine.register_memory(staging.data_ptr(), num_bytes) != 0:
            raise KVTransferError("connection", "Mooncake could not register a staging buffer")

    def _deregister_staging(self, staging: torch.Tensor, registration: None) -> None:
        self.engine.unregister_memory(staging.data_ptr())

    def _read_regions(
        self, source: BlockSource, remote: MemoryHandle, regions: np.ndarray, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        for start in range(0, len(regions), MAX_BATCH):
            local, far, lengths = (
                regions[start : start + MAX_BATCH, column].tolist() for column in range(3)
            )
            if time.monotonic() > deadline:
                raise KVTransferError("timeout", f"the mooncake read passed {timeout} s")
            if self.engine.batch_transfer_sync_read(remote.peer, local, far, lengths) != 0:
                kind = "timeout" if time.monotonic() > deadline else "connection"
                raise KVTransferError(kind, f"the mooncake read from {remote.peer} failed")
