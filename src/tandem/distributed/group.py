"""One tensor-parallel group: this process's rank among `size` ranks and the collectives that
the parallel layers call (NCCL on CUDA, gloo on the CPU).

    TensorParallelGroup.single()            size 1: every collective is the identity
    join_group(rank, size, store_address, device)   every rank calls it; returns when all joined

With `expert_parallel` (--enable-expert-parallel) a mixture-of-experts layer places whole
experts on the ranks (`sharding.py`); the collectives are the same.

The group is an explicit object handed to the model (no global state), its process group built
on a `TCPStore` that rank 0 hosts, so one process can start (and end) several engines. Every rank
calls the collectives in the same order with the same shapes (the same forward on the same batch).
A rank that dies makes gloo's pending collective raise at once; NCCL's would wait, so the
executor's monitor aborts the group (`abort`).

On CUDA a sum of at most PEER_MEMORY_MAX_BYTES (a decode step's) goes through
`PeerMemoryAllReduce`: one kernel that reads every rank's copy over NVLink (torch's symmetric
memory, one-shot), about a third of NCCL's time (benchmarks/all_reduce.py); where a residual add
and RMSNorm follow the sum (a decoder layer's projections), a group of two ranks does all three
in one kernel of ours (`all_reduce_add_rms_norm`, `fused_all_reduce.py`) on a buffer of its own;
on such a group a step of at least SEQUENCE_SPLIT_MIN_TOKENS tokens may run sequence-parallel
(`split_sequence`): each rank keeps its slice of the tokens between the layers, and the products
gather or scatter the rows while they multiply (torch's fused symmetric-memory ops).
`--disable-custom-all-reduce` (vLLM's flag) keeps NCCL for all.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:  # its kernel needs Triton, which CUDA alone brings
    from tandem.distributed.fused_all_reduce import AllReduceAddRMSNorm

logger = logging.getLogger(__name__)

# A collective that waits this long means a rank is stuck or gone: it raises instead.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# Sums up to this size read the peers' copies directly; larger ones (a prompt's) go through NCCL,
# whose ring is faster once the bytes, not the latency, dominate.
PEER_MEMORY_MAX_BYTES = 1 << 20
# Two ways of summing kept to small groups (docs/benchmarks.md, the 8B shape on H200s). The sum
# fused with the residual add and RMSNorm after it took 0.2 to 0.6 ms off a decode step of 32 and
# 64 sequences at two ranks and 0.2 ms off TP=4's steps (19 starts in a row at four ranks since
# its call count is one atomic; about one in five hung before). Eight ranks were never measured.
# A prompt step split over the ranks took an 8192-token prefill from 137 to 132 ms at two, and
# from 86 to 130 ms at four. Larger groups keep the one-shot sum and NCCL.
FUSED_ADD_NORM_MAX_RANKS = 4
SEQUENCE_SPLIT_MAX_RANKS = 2
# A step of at least this many tokens may run sequence-parallel.
SEQUENCE_SPLIT_MIN_TOKENS = 2048
# Whether this process has set up peer memory for a group already. A second setup in the same
# process waits forever in torch's rendezvous against freshly started ranks (seen on 2 x H200,
# torch 2.11: an engine started after another in one process), so a second group stays on NCCL.
_peer_memory_set_up = False


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
    peer_memory: PeerMemoryAllReduce | None = None  # small sums on CUDA, when set up
    # small sums with the residual add and RMSNorm after them, set up with peer_memory
    sum_add_norm: AllReduceAddRMSNorm | None = None
    # in a sequence-parallel step: (tokens of the step, rows of each rank's slice); else None
    sequence_split: tuple[int, int] | None = None

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(0, 1)

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that samples and that the engine core runs in its own process."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks: in place, or a new tensor when the peer-memory
        path takes it (callers use the returned tensor)."""
        if self.size == 1:
            return tensor
        if self.peer_memory is not None and self.peer_memory.takes(tensor):
            return self.peer_memory(tensor)
        self.process_group.allreduce([tensor]).wait()
        return tensor

    def fuses_add_rms_norm(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce_add_rms_norm` takes this rank's partial sums x in one kernel."""
        return (
            self.sum_add_norm is not None
            and self.sequence_split is None
            and self.sum_add_norm.takes(x)
        )

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += the sum of x over the ranks (in place); returns weight * rms_norm(residual),
        in one kernel (where `fuses_add_rms_norm(x)`)."""
        return self.sum_add_norm(x, residual, weight, eps)

    def can_split_sequence(self, num_tokens: int) -> bool:
        return (
            self.peer_memory is not None
            and self.size <= SEQUENCE_SPLIT_MAX_RANKS
            and num_tokens >= SEQUENCE_SPLIT_MIN_TOKENS
            and not torch.cuda.is_current_stream_capturing()
        )

    @contextlib.contextmanager
    def split_sequence(self, num_tokens: int) -> Iterator[None]:
        """Within it, the parallel linear layers take and give this rank's slice of the rows
        (`own_rows`: the step's rows padded with zero rows to a slice a rank)."""
        self.sequence_split = (num_tokens, -(-num_tokens // self.size))
        try:
            yield
        finally:
            self.sequence_split = None

    def padded_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The step's rows, with or without the padding rows, padded with zero rows."""
        padded = self.sequence_split[1] * self.size
        return x if x.shape[0] == padded else F.pad(x, (0, 0, 0, padded - x.shape[0]))

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the step's rows (padded)."""
        rows = self.sequence_split[1]
        return self.padded_rows(x)[self.rank * rows : (self.rank + 1) * rows]

    def all_gather_matmul(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Every rank's `rows` stacked in rank order, times weight.T (padding rows included)."""
        _, (product,) = torch.ops.symm_mem.fused_all_gather_matmul(
            rows, [weight.t()], 0, self.peer_memory.name
        )
        return product

    def matmul_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """(x @ weight.T) summed over the ranks, this rank's slice of its rows (x: the step's
        tokens, with or without the padding rows)."""
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            self.padded_rows(x), weight.t(), "sum", 0, self.peer_memory.name
        )

    def all_gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the step's rows, stacked (the step's tokens only)."""
        stacked = rows.new_empty(rows.shape[0] * self.size, *rows.shape[1:])
        self.process_group.allgather([list(stacked.chunk(self.size))], [rows]).wait()
        return stacked[: self.sequence_split[0]]

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

    def broadcast_from_first(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every other rank's (same shape and dtype), in place."""
        if self.size == 1:
            return
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.process_group.broadcast([tensor], options).wait()

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


class PeerMemoryAllReduce:
    """Sums of small tensors of one dtype through a buffer that every rank maps (symmetric
    memory): each rank copies its tensor into its buffer, then every rank adds all the buffers
    over NVLink, in one kernel with a barrier on the way in and out (so one buffer serves one
    sum after another, and CUDA graphs capture it). Set up collectively by `join_group`."""

    def __init__(self, name: str, group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group  # torch's registry holds it weakly: it lives as long as this does
        symm_mem.rendezvous(buffer, name)  # collective: maps every rank's buffer
        self.name = name
        self.buffer = buffer

    def takes(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.dtype == self.buffer.dtype
            and tensor.numel() <= self.buffer.numel()
            and tensor.is_contiguous()
        )

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.view(-1)
        out = torch.empty_like(flat)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self.buffer[: flat.numel()], flat, "sum", self.name, out
        )
        return out.view_as(tensor)


def set_up_peer_memory(
    tp: TensorParallelGroup, name: str, store: dist.Store, device: torch.device, dtype: torch.dtype
) -> None:
    """Give a CUDA group the peer-memory path when every pair of its GPUs can map each other's
    memory and every rank could allocate its buffer; otherwise its sums all stay on NCCL. The
    ranks agree (one NCCL all-reduce) before the collective rendezvous, so none waits alone.
    Once per process: a later group in the same process (tests, a restarted engine) stays on
    NCCL."""
    global _peer_memory_set_up
    devices = [device.index - tp.rank + rank for rank in range(tp.size)]
    with torch.cuda.device(device):
        ready, group, buffer, fused_buffer = True, None, None, None
        if _peer_memory_set_up:
            logger.info("tensor parallelism: peer memory is set up once per process, NCCL here")
            ready = False
        elif not all(
            torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b
        ):
            logger.info("tensor parallelism: no peer access between the GPUs, all-reduces on NCCL")
            ready = False
        else:
            try:
                import torch.distributed._symmetric_memory as symm_mem

                from tandem.distributed.fused_all_reduce import AllReduceAddRMSNorm

                group = register_by_name(name, tp, dist.PrefixStore("peer-memory", store))
                numel = PEER_MEMORY_MAX_BYTES // dtype.itemsize
                buffer = symm_mem.empty(numel, dtype=dtype, device=device)
                if tp.size <= FUSED_ADD_NORM_MAX_RANKS:
                    fused_buffer = AllReduceAddRMSNorm.allocate(
                        tp.size, PEER_MEMORY_MAX_BYTES, dtype, device
                    )
            except (RuntimeError, ImportError) as exc:
                logger.warning("tensor parallelism: all-reduces on NCCL (peer memory: %s)", exc)
                ready = False
        agreed = torch.tensor([int(ready)], device=device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        tp.process_group.allreduce([agreed], options).wait()
        if agreed.item():
            _peer_memory_set_up = True
            tp.peer_memory = PeerMemoryAllReduce(name, group, buffer)
            if fused_buffer is not None:
                tp.sum_add_norm = AllReduceAddRMSNorm(name, tp.rank, tp.size, dtype, fused_buffer)


def register_by_name(name: str, tp: TensorParallelGroup, store: dist.Store) -> dist.ProcessGroup:
    """Make the group's NCCL backend a c10d process group that torch finds by `name` (symmetric
    memory looks its group up so), as `torch.distributed.new_group` would register it."""
    from torch._C._distributed_c10d import _register_process_group

    group = dist.ProcessGroup(store, tp.rank, tp.size)
    nccl = dist.ProcessGroup.BackendType.NCCL
    group._set_default_backend(nccl)
    group._register_backend(torch.device("cuda"), nccl, tp.process_group)
    group._set_group_name(name)
    _register_process_group(name, group)
    return group


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
    peer_memory_dtype: torch.dtype | None = None,
) -> TensorParallelGroup:
    """This rank's group (NCCL on CUDA, gloo on the CPU); rank 0 passes the store it hosts.
    With `peer_memory_dtype` on CUDA, small sums of that dtype take the peer-memory path."""
    if store is None:
        store = dist.TCPStore(
            address.host, address.port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT
        )
    prefixed = dist.PrefixStore("tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        tp = TensorParallelGroup(rank, size, dist.ProcessGroupNCCL(prefixed, rank, size, options))
        if peer_memory_dtype is not None:
            name = f"tandem-tp-{address.host}:{address.port}"  # the same on every rank
            set_up_peer_memory(tp, name, store, device, peer_memory_dtype)
        return tp
    return TensorParallelGroup(
        rank, size, dist.ProcessGroupGloo(prefixed, rank, size, COLLECTIVE_TIMEOUT)
    )
