"""The Triton attention backend: paged-KV flash attention for prefill and split-K decode.

`forward` stores the new k/v at `slot_mapping` (`store_kv`), then `attend` launches one of two
paths:

* decode-only batches (`metadata.is_decode_only`): `decode_attention_kernel` over
  (sequence, kv head, split), each split an even share of that context in whole key tiles; the
  last split of a context to finish combines the splits by log-sum-exp (one launch in all);
* anything else (prefill chunks, prefix hits, mixed prefill + decode): `prefill_attention_kernel`
  over (query tile, sequence, kv head), which handles query_len 1 as well.

Invariants: head_dim is a power of two in [16, 256]; the last dimension of q, k, v and the caches
is contiguous (other strides are free, so q may be a view into a fused qkv tensor); the output has
q's dtype and the caches' dtype is the compute dtype (q is cast to it, as the torch reference
does); accumulation is fp32, and fp32 caches use exact fp32 dots (no tf32). The launch shapes
depend only on tensor shapes and `metadata.max_query_len` / `max_seq_len`, never on tensor values,
so nothing synchronises with the device. The kernels live in `tandem.attention.triton_kernels`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.attention.triton_kernels import (
    decode_attention_kernel,
    prefill_attention_kernel,
    store_kv_kernel,
)
from tandem.pdl import pdl_options

_LOG2_E = 1.4426950408889634
_MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile shapes and launch parameters; None picks a default from head_dim and dtype."""

    prefill_block_m: int | None = None  # rows per query tile: (token, head-in-group) pairs
    prefill_block_n: int | None = None  # keys per inner step
    prefill_num_warps: int | None = None
    prefill_num_stages: int | None = None
    decode_block_n: int | None = None
    decode_num_warps: int | None = None
    decode_num_stages: int | None = None
    decode_min_keys_per_split: int = 128  # launch at most max_seq_len / this many splits
    decode_max_splits: int = 64
    decode_programs_per_sm: int = 2  # aim for this many decode programs per multiprocessor


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter runs: any fixed number keeps launches deterministic
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"the triton attention backend needs a power-of-two head_dim in [16, 256], got "
            f"{head_dim}; use the torch backend for this model"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same dtype")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} differs from the query's {head_dim}")
    if k_cache.stride(3) != 1:
        raise ValueError("the KV cache's last dimension must be contiguous")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    capturable = True

    def __init__(self, config: TritonAttentionConfig | None = None) -> None:
        self.config = config or TritonAttentionConfig()
        self._counters: dict[torch.device, torch.Tensor] = {}
        self._every_counter_buffer: list[torch.Tensor] = []

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _check_shapes(q, k_cache, v_cache)  # before the store touches the cache
        return super().forward(q, k, v, k_cache, v_cache, metadata, scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(q, k_cache, v_cache)
        q = _last_dim_contiguous(q)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if q.shape[0] == 0:
            return out
        if metadata.is_decode_only:
            self._decode(q, k_cache, v_cache, metadata, scale, out)
        else:
            self._prefill(q, k_cache, v_cache, metadata, scale, out)
        return out

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
        num_tokens = k.shape[0]
        if num_tokens == 0:
            return
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        store_kv_kernel[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1],
            NUM_KV_HEADS=num_kv_heads,
            KV_HEADS_POW2=triton.next_power_of_2(num_kv_heads),
            HEAD_DIM=head_dim,
        )

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        head_dim = q.shape[2]
        group = q.shape[1] // k_cache.shape[2]
        wide = head_dim > 128 or k_cache.dtype == torch.float32
        cfg = self.config
        block_m = cfg.prefill_block_m or (64 if wide else 128)
        block_m = max(block_m, triton.next_power_of_2(group), _MIN_DOT_ROWS)
        block_n = cfg.prefill_block_n or (32 if wide else 128)
        block_q = block_m // group
        num_query_tiles = triton.cdiv(metadata.max_query_len, block_q)
        grid = (num_query_tiles, metadata.num_seqs, k_cache.shape[2])
        prefill_attention_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale * _LOG2_E,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            metadata.block_tables.stride(0),
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            DOT_PRECISION=_dot_precision(k_cache.dtype),
            num_warps=cfg.prefill_num_warps or 8,
            num_stages=cfg.prefill_num_stages or 2,
        )

    def num_decode_splits(self, metadata: AttentionMetadata, num_kv_heads: int, device) -> int:
        """How many splits each decode context is cut into (a function of shapes only)."""
        cfg = self.config
        programs_wanted = cfg.decode_programs_per_sm * _multiprocessor_count(device)
        by_occupancy = triton.cdiv(programs_wanted, metadata.num_seqs * num_kv_heads)
        by_length = triton.cdiv(metadata.max_seq_len, cfg.decode_min_keys_per_split)
        return max(1, min(by_occupancy, by_length, cfg.decode_max_splits))

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        num_seqs = metadata.num_seqs
        cfg = self.config
        block_n = cfg.decode_block_n or (32 if k_cache.dtype == torch.float32 else 64)
        num_splits = self.num_decode_splits(metadata, num_kv_heads, q.device)
        if num_splits > 1:
            partial_out = torch.empty(
                num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
            )
            partial_lse = torch.empty(
                num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device
            )
        else:
            partial_out = partial_lse = out  # not touched when there is one split
        split_counters = self._split_counters(num_seqs * num_kv_heads, q.device)
        decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            out,
            partial_out,
            partial_lse,
            split_counters,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale * _LOG2_E,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            metadata.block_tables.stride(0),
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits,
            SPLITS_POW2=triton.next_power_of_2(num_splits),
            GROUP=group,
            BLOCK_H=max(triton.next_power_of_2(group), _MIN_DOT_ROWS),
            HEAD_DIM=head_dim,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_N=block_n,
            DOT_PRECISION=_dot_precision(k_cache.dtype),
            num_warps=cfg.decode_num_warps or 4,
            num_stages=cfg.decode_num_stages or 3,
            **pdl_options(q.device),
        )

    def _split_counters(self, size: int, device: torch.device) -> torch.Tensor:
        """Zeroed int32 counters the decode kernel leaves at zero. CUDA graphs keep the address
        they captured, so a buffer that is outgrown is kept alive, never freed."""
        counters = self._counters.get(device)
        if counters is None or counters.numel() < size:
            counters = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
            self._counters[device] = counters
            self._every_counter_buffer.append(counters)
        return counters


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
