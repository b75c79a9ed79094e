"""One tensor-parallel group: this process's rank among `size` ranks and the collectives that
the parallel layers call (NCCL on CUDA, gloo on the CPU).

    TensorParallelGroup.single()            size 1: every collective is the identity
    join_group(rank, size, store_address, device)   every rank calls it; returns when all joined

With `expert_parallel` (--enable-expert-parallel) a mixture-of-experts layer places whole
experts on the ranks instead of splitting every expert (`sharding.py`); the collectives are the
same.

The group is an explicit object handed to the model (no global state): its process group is
built on a `TCPStore` that rank 0 hosts, not through `torch.distributed.init_process_group`, so
one process can start (and end) several engines. Collectives block until every rank calls them
in the same order with the same shapes: every rank runs the same forward on the same batch.

A rank that dies makes gloo's pending collective raise at once ("Connection closed by peer");
NCCL's would wait, so the executor's monitor aborts the group (`abort`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits this long means a rank is stuck or gone: it raises instead.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int


@dataclass
class TensorParallelGroup:
    rank: int
    size: int
    process_group: dist.ProcessGroup | None = None  # None for size 1
    expert_parallel: bool = False  # experts placed whole on the ranks

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(0, 1)

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that samples and that the engine core runs in its own process."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks, in place."""
        if self.size > 1:
            self.process_group.allreduce([tensor]).wait()
        return tensor

    def gather_on_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` ([rows, columns], same shape on all) side by side on rank 0:
        [rows, size * columns], rank r's at columns r * columns...; None on the other ranks."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.is_first else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.process_group.gather(outputs, [tensor], options).wait()
        return torch.cat(outputs[0], dim=-1) if self.is_first else None

    @property
    def uses_nccl(self) -> bool:
        return self.process_group is not None and isinstance(
            self.process_group, getattr(dist, "ProcessGroupNCCL", ())
        )

    def abort(self) -> None:
        """Make collectives pending on this rank fail (NCCL; gloo fails them by itself)."""
        abort = getattr(self.process_group, "abort", None)
        if abort is not None:
            abort()


def host_store(size: int) -> tuple[dist.TCPStore, StoreAddress]:
    """Rank 0's rendezvous store on a free loopback port, which the other ranks join."""
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
    )
    return store, StoreAddress("127.0.0.1", store.port)


def join_group(
    rank: int,
    size: int,
    address: StoreAddress,
    device: torch.device,
    store: dist.TCPStore | None = None,
) -> TensorParallelGroup:
    """This rank's group (NCCL on CUDA, gloo on the CPU); rank 0 passes the store it hosts."""
    if store is None:
        store = dist.TCPStore(
            address.host, address.port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT
        )
    prefixed = dist.PrefixStore("tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, size, COLLECTIVE_TIMEOUT)
    return TensorParallelGroup(rank, size, group)
