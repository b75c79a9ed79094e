"""Linear layers that own their weights ([out, in], named as the checkpoint's), split over the
ranks of a tensor-parallel group, and load each rank's slice of a checkpoint tensor.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)`, which copies this
rank's part of one checkpoint tensor into its place. A column-parallel layer keeps a slice of
the output rows (its output is this rank's heads or MLP rows: no communication); a row-parallel
layer keeps a slice of the input columns and sums its partial output over the ranks:

    ColumnParallelLinear(in, out)       weight [out / size, in]     rows r * out / size ...
    MergedColumnParallelLinear(in, [a, b])  each projection split so, this rank's parts stacked:
                                        weight = [ a's rows of rank r ; b's rows of rank r ]
    QKVParallelLinear                   q/k/v by heads (KV heads replicated when fewer than
                                        ranks: `tandem.distributed.sharding`)
    RowParallelLinear(in, out)          weight [out, in / size]; y = all_reduce(x W_r^T) + b

In a sequence-parallel step (`TensorParallelGroup.split_sequence`) a column-parallel layer takes
this rank's slice of the rows and gives every row, a row-parallel one takes every row and gives
this rank's slice of the sums.

At size 1 each is the plain layer (a merged one still packs its projections: one matmul
instead of several). A checkpoint tensor may be a lazy safetensors slice: only this rank's rows
or columns are read from it. A shape that does not match raises ValueError naming the expected
shape. With the fused kernels, a row or a few (decode) may take Triton's matrix-vector kernel,
where it is the faster one.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.group import TensorParallelGroup
from tandem.distributed.sharding import HeadRange, even_part, kv_head_range
from tandem.models.layers import fused_kernels
from tandem.models.layers.norm import RMSNorm

# A checkpoint tensor: a tensor, or a safetensors slice that reads what it is indexed with.
CheckpointTensor = Any


def shape_of(loaded: CheckpointTensor) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def narrow(loaded: CheckpointTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Indices [start, start + length) of dimension `dim` (0 or 1) of a checkpoint tensor."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    return loaded[(slice(None),) * dim + (slice(start, start + length),)]


def materialize(loaded: CheckpointTensor) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def check_shape(loaded: CheckpointTensor, expected: Sequence[int]) -> None:
    if shape_of(loaded) != tuple(expected):
        raise ValueError(f"has shape {shape_of(loaded)}, the model expects {tuple(expected)}")


def copy_weight(dest: torch.Tensor, loaded_weight: CheckpointTensor) -> None:
    """Copy a checkpoint tensor into a parameter (or its part) of the same shape, in the
    parameter's dtype: the loader of a parameter that has no `weight_loader` of its own."""
    check_shape(loaded_weight, dest.shape)
    dest.copy_(materialize(loaded_weight).to(dest.dtype))


class LinearBase(nn.Module, abc.ABC):
    """y = x W^T (+ b), W this rank's [output_size, input_size]."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        fused: bool,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.fused = fused
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    @abc.abstractmethod
    def weight_loader(
        self, param: torch.Tensor, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        """Copy this rank's part of one checkpoint tensor into `param` (weight or bias)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fused and x.dtype != torch.float32:
            kernels = fused_kernels()
            if kernels.prefers_small_batch_linear(x.shape[0], *self.weight.shape):
                return kernels.small_batch_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Projections of one input, each split by output rows over the ranks; this rank's parts
    stacked. `shards[i]`: (rows of checkpoint projection i, this rank's part of them)."""

    def __init__(
        self,
        input_size: int,
        shards: Sequence[tuple[int, HeadRange]],
        bias: bool = False,
        fused: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.shards = list(shards)
        local_size = sum(part.count for _, part in self.shards)
        super().__init__(input_size, local_size, bias, fused, tp or TensorParallelGroup.single())

    @classmethod
    def even(
        cls,
        input_size: int,
        output_size: int,
        bias: bool = False,
        fused: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> ColumnParallelLinear:
        """One projection split evenly by rows."""
        tp = tp or TensorParallelGroup.single()
        return cls(input_size, [(output_size, even_part(output_size, tp.rank, tp.size))],
                   bias, fused, tp)  # fmt: skip

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            if self.num_shards > 1:
                raise ValueError("is one of several stacked projections: it needs its shard index")
            shard_id = 0
        full_rows, part = self.shards[shard_id]
        check_shape(loaded_weight, (full_rows, *param.shape[1:]))
        offset = sum(p.count for _, p in self.shards[:shard_id])
        copy_weight(
            param.narrow(0, offset, part.count), narrow(loaded_weight, 0, part.start, part.count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_split is None:
            return self.matmul(x, self.bias)
        y = self.tp.all_gather_matmul(x, self.weight)  # x: this rank's slice of the rows
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of one input (gate/up), each split evenly by rows."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        fused: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or TensorParallelGroup.single()
        shards = [(size, even_part(size, tp.rank, tp.size)) for size in output_sizes]
        super().__init__(input_size, shards, bias, fused, tp)


class QKVParallelLinear(ColumnParallelLinear):
    """[q; k; v] of this rank's heads: query heads split evenly, KV heads split or replicated."""

    def __init__(
        self,
        input_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        fused: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or TensorParallelGroup.single()
        heads = even_part(num_heads, tp.rank, tp.size)
        self.kv_heads = kv_head_range(num_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = heads.count, self.kv_heads.count

        def rows(part: HeadRange) -> HeadRange:
            return HeadRange(part.start * head_dim, part.count * head_dim)

        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        shards = [(q_rows, rows(heads)), (kv_rows, rows(self.kv_heads))]
        super().__init__(input_size, [*shards, shards[1]], bias, fused, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = super().forward(x)
        split = self.tp.sequence_split
        return qkv if split is None else qkv[: split[0]]  # attention takes the step's tokens


class RowParallelLinear(LinearBase):
    """Split by input columns: each rank multiplies its slice of the input (the column-parallel
    layer's output before it) and the partial outputs are summed over the ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        fused: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or TensorParallelGroup.single()
        self.columns = even_part(input_size, tp.rank, tp.size)
        self.input_size = input_size
        super().__init__(self.columns.count, output_size, bias, fused, tp)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        if param.dim() == 1:  # the bias, added once after the sum
            copy_weight(param, loaded_weight)
            return
        check_shape(loaded_weight, (param.shape[0], self.input_size))
        copy_weight(param, narrow(loaded_weight, 1, self.columns.start, self.columns.count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        if self.tp.sequence_split is None:
            y = self.tp.all_reduce(self.matmul(x, None))
        else:  # this rank's slice of the rows
            y = self.tp.matmul_reduce_scatter(x, self.weight)
        return y if self.bias is None else y + self.bias

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm.add_forward(self(x), residual), the sum over the ranks, the residual add and the
        norm in one kernel where the group takes them (a decode step's rows on CUDA)."""
        if self.tp.size == 1 or self.tp.sequence_split or self.bias is not None or not norm.fused:
            return norm.add_forward(self(x), residual)
        partial = self.matmul(x, None)
        if self.tp.fuses_add_rms_norm(partial):
            out = self.tp.all_reduce_add_rms_norm(partial, residual, norm.weight, norm.eps)
            return out, residual
        return norm.add_forward(self.tp.all_reduce(partial), residual)
