"""KV transfer for a tensor-parallel engine over tcp: rank 0 relays its ranks' KV shards over
the tensor-parallel group (gloo on the CPU, NCCL on CUDA), so the engine keeps one KV port, one
control plane and one lease per transfer, and kv_transfer_params keep vLLM's fields. (The planes
that read in place read rank by rank instead: kv/connector/rank_reads.py.)

    prefill: each layer's save gathers every rank's KV-head shard of the prompt's blocks on
             rank 0 (`gather_heads`), which stages the whole layer (all the model's KV heads)
    decode:  rank 0's data plane reads the layers (every KV head, only the blocks this
             engine lacks) into host staging; the next step's metadata lists the read under
             `installs`, and every rank takes its KV-head range of it (`scatter_heads`) before
             the step's forward; only then does rank 0 report the load finished, so every rank
             holds its heads before the prompt counts as computed, and the prefill's lease was
             confirmed once, by rank 0's read

The transfer's layout on the wire is the model's (every KV head), so a prefill and a decode of
different tensor-parallel sizes pair as long as the model's layout matches. Replicated KV heads
(fewer than ranks): the gather takes each head from the first rank that holds it.
Invariant: every rank makes the same collectives in the same order (the metadata is the same on
every rank: rank 0 broadcasts it with the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from tandem.distributed.group import TensorParallelGroup
from tandem.distributed.sharding import kv_head_range
from tandem.kv.connector.base import KVConnectorWorker
from tandem.kv.connector.metadata import InstallSpec, KVConnectorMetadata


@dataclass(frozen=True)
class RankLayout:
    """The KV heads of each rank of an engine: rank r holds [starts[r], starts[r] + count)."""

    num_kv_heads: int  # the model's
    starts: tuple[int, ...]
    count: int

    @classmethod
    def of(cls, num_kv_heads: int, size: int) -> RankLayout:
        ranges = [kv_head_range(num_kv_heads, rank, size) for rank in range(size)]
        return cls(num_kv_heads, tuple(r.start for r in ranges), ranges[0].count)

    @property
    def size(self) -> int:
        return len(self.starts)


class HeadRelay:
    """This rank's part of the collectives that move KV-head shards through rank 0."""

    def __init__(self, tp: TensorParallelGroup, layout: RankLayout) -> None:
        self.tp = tp
        self.layout = layout
        # which rank's shard each of the model's heads comes from (the first holding it)
        self.head_owner = [
            min(r for r, s in enumerate(layout.starts) if s <= head < s + layout.count)
            for head in range(layout.num_kv_heads)
        ]

    def gather_heads(self, shard: torch.Tensor) -> torch.Tensor | None:
        """shard [..., heads of this rank, head_dim] -> on rank 0 [..., the model's heads,
        head_dim]; None on the other ranks."""
        shard = shard.contiguous()
        parts = [[torch.empty_like(shard) for _ in range(self.tp.size)]] if self.tp.is_first else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.tp.process_group.gather(parts, [shard], options).wait()
        if not self.tp.is_first:
            return None
        starts, heads = self.layout.starts, []
        for head, rank in enumerate(self.head_owner):
            heads.append(parts[0][rank].narrow(-2, head - starts[rank], 1))
        return torch.cat(heads, dim=-2)

    def scatter_heads(self, whole: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """Rank 0's `whole` [..., the model's heads, head_dim] -> this rank's heads of it
        (`like`: a tensor of this rank's shard's shape, dtype and device)."""
        received = torch.empty_like(like)
        parts = []
        if self.tp.is_first:
            count = self.layout.count
            parts = [[whole.narrow(-2, start, count).contiguous() for start in self.layout.starts]]
        options = dist.ScatterOptions()
        options.rootRank = 0
        self.tp.process_group.scatter([received], parts, options).wait()
        return received


def install_shards(
    relay: HeadRelay,
    kv_cache: torch.Tensor,
    install: InstallSpec,
    layers: list[torch.Tensor] | None,
) -> None:
    """Every rank: write this rank's heads of a read's blocks (rank 0's host `layers`, one
    [2, blocks read, block_size, heads, head_dim] per layer) into its blocks install.block_ids."""
    targets = torch.tensor(install.block_ids, dtype=torch.long, device=kv_cache.device)
    num_blocks = len(install.block_ids)
    like = torch.empty(
        (2, num_blocks, *kv_cache.shape[3:]), dtype=kv_cache.dtype, device=kv_cache.device
    )
    for layer_index in range(kv_cache.shape[0]):
        whole = None
        if layers is not None:
            whole = layers[layer_index].to(kv_cache.device)
        kv_cache[layer_index].index_copy_(1, targets, relay.scatter_heads(whole, like))


class ShardKVConnectorWorker(KVConnectorWorker):
    """The worker side of a rank other than 0: it takes part in rank 0's gathers (saves) and
    scatters (installs), and reports nothing (rank 0 reports for the engine)."""

    def __init__(self, relay: HeadRelay) -> None:
        self.relay = relay
        self.kv_cache: torch.Tensor | None = None

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def save_kv_layer(self, layer_index: int, metadata) -> None:
        metadata = as_metadata(metadata)
        if metadata is None:
            return
        for spec in metadata.saves:
            index = torch.tensor(spec.block_ids, device=self.kv_cache.device)
            self.relay.gather_heads(self.kv_cache[layer_index].index_select(1, index))

    def start_load_kv(self, metadata) -> None:
        metadata = as_metadata(metadata)
        if metadata is None:
            return
        for install in metadata.installs:
            install_shards(self.relay, self.kv_cache, install, None)


def as_metadata(metadata) -> KVConnectorMetadata | None:
    """The step's metadata as rank 0 built it (the other ranks decode it from msgpack)."""
    if metadata is None or isinstance(metadata, KVConnectorMetadata):
        return metadata
    return msgspec.convert(metadata, KVConnectorMetadata)
