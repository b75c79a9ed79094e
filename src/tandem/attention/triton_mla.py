"""Triton decode attention for DeepSeek's latent attention (MLA), absorbed form, on the paged cache.

A decode-only batch (one query token per sequence) attends as one shared KV head of width D =
kv_lora_rank + qk_rope_head_dim, read from the layer's cache through the block tables in place:

    query  q [T, heads, D] = [q_nope W_UK | q_rope]      latent of a token = [c | k_rope]
    score  = q · latent * scale      out [T, heads, kv_lora_rank] = softmax(scores) · c

The cache of one layer is [2, blocks, block_size, 1, D / 2], a latent's first half in plane 0
(`tandem.models.layers.mla`); each latent dim maps to its plane's address, so c and k_rope are
read once per key tile, and the c tile serves as both key and value.

    mla_decode_kernel   grid (B, head blocks, splits): one split of a context (flash-decoding)
                        for BLOCK_H heads; with one split it writes the output, else a partial
                        output (normalised within the split) and its log-sum-exp (base 2)
    mla_combine_kernel  grid (B, heads), only when splits > 1: the used splits of a context
                        combined by log-sum-exp into the output
    store_latents_kernel  grid (T,): each token's latent into its slot (-1: none), no host sync

Invariants: a context is cut into splits by its own length in whole key tiles, so splits past it
write nothing and the combine reads only the used ones; a sequence with no query token (padding)
is skipped; launch shapes depend on tensor shapes and `metadata.max_seq_len` only (no host sync:
CUDA graphs capture them). Inputs are in the cache's dtype (q is cast to it, as the torch path
does); softmax and accumulation are fp32 (fp32 caches use exact fp32 dots); output in q's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tandem.attention.base import AttentionMetadata
from tandem.pdl import pdl_options, wait_for_previous

_LOG2_E = 1.4426950408889634
BLOCK_H = 16  # heads per program; tl.dot needs at least 16 rows
MIN_KEYS_PER_SPLIT = 128  # launch at most max_seq_len / this many splits
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2  # aim for this many decode programs per multiprocessor


@triton.jit
def _keys_per_split(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Context positions per split: an even share of seq_len, in whole key tiles."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _dim_offsets(dims, HALF: tl.constexpr, stride_cache_plane):
    """Address of each latent dim within a token's slot: plane 0 below HALF, plane 1 from it."""
    return tl.where(dims < HALF, 0, stride_cache_plane - HALF) + dims


@triton.jit
def mla_decode_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_plane,
    stride_cache_block,
    stride_cache_token,
    stride_block_tables_seq,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LATENT: tl.constexpr,
    LATENT_POW2: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_POW2: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Partials (NUM_SPLITS > 1): partial_out [B, NUM_HEADS, NUM_SPLITS, LATENT] and partial_lse
    [B, NUM_HEADS, NUM_SPLITS], fp32."""
    wait_for_previous(USE_PDL)
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq)
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    key_begin = split * _keys_per_split(seq_len, NUM_SPLITS, BLOCK_N)
    if (key_begin >= seq_len) | (query_end == token):
        return
    key_end = tl.minimum(key_begin + _keys_per_split(seq_len, NUM_SPLITS, BLOCK_N), seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < NUM_HEADS
    latent_dims = tl.arange(0, LATENT_POW2)
    latent_valid = latent_dims < LATENT
    rope_dims = tl.arange(0, ROPE_POW2)
    rope_valid = rope_dims < ROPE
    token = token.to(tl.int64)
    q_rows = q_ptr + token * stride_q_token + heads * stride_q_head
    q_latent = tl.load(
        q_rows[:, None] + latent_dims[None, :],
        mask=head_valid[:, None] & latent_valid[None, :],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)  # [BLOCK_H, LATENT_POW2]
    q_rope = tl.load(
        q_rows[:, None] + LATENT + rope_dims[None, :],
        mask=head_valid[:, None] & rope_valid[None, :],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)  # [BLOCK_H, ROPE_POW2]
    latent_offsets = _dim_offsets(latent_dims, HALF, stride_cache_plane)
    rope_offsets = _dim_offsets(LATENT + rope_dims, HALF, stride_cache_plane)

    acc = tl.zeros([BLOCK_H, LATENT_POW2], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    for key_start in range(key_begin, key_end, BLOCK_N):
        key_pos = key_start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < key_end
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        slots = (
            block_ids.to(tl.int64) * stride_cache_block
            + (key_pos % BLOCK_SIZE) * stride_cache_token
        )
        latents = tl.load(
            cache_ptr + slots[None, :] + latent_offsets[:, None],
            mask=latent_valid[:, None] & key_valid[None, :],
            other=0.0,
        )  # [LATENT_POW2, BLOCK_N]: c, the keys' first part and the values
        k_rope = tl.load(
            cache_ptr + slots[None, :] + rope_offsets[:, None],
            mask=rope_valid[:, None] & key_valid[None, :],
            other=0.0,
        )  # [ROPE_POW2, BLOCK_N]
        qk = tl.dot(q_latent, latents, input_precision=DOT_PRECISION)
        qk = tl.dot(q_rope, k_rope, acc=qk, input_precision=DOT_PRECISION) * qk_scale  # base 2
        qk = tl.where(key_valid[None, :], qk, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(qk, 1))
        correction = tl.exp2(row_max - new_max)
        p = tl.exp2(qk - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(
            p.to(latents.dtype), tl.trans(latents), input_precision=DOT_PRECISION
        )
        row_max = new_max

    out = acc / row_sum[:, None]
    valid = head_valid[:, None] & latent_valid[None, :]
    if NUM_SPLITS == 1:
        out_rows = out_ptr + token * stride_out_token + heads * stride_out_head
        tl.store(out_rows[:, None] + latent_dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=valid)  # fmt: skip
    else:
        partial_rows = (seq.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(partial_out_ptr + partial_rows[:, None] * LATENT + latent_dims[None, :], out,
                 mask=valid)  # fmt: skip
        tl.store(partial_lse_ptr + partial_rows, row_max + tl.log2(row_sum), mask=head_valid)


@triton.jit
def mla_combine_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    LATENT: tl.constexpr,
    LATENT_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == token:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used_splits = tl.cdiv(seq_len, _keys_per_split(seq_len, NUM_SPLITS, BLOCK_N))
    first_row = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_POW2)
    lse = tl.load(
        partial_lse_ptr + first_row + splits, mask=splits < num_used_splits, other=float("-inf")
    )
    lse_max = tl.max(lse, 0)
    weight_sum = tl.sum(tl.exp2(lse - lse_max), 0)
    dims = tl.arange(0, LATENT_POW2)
    acc = tl.zeros([LATENT_POW2], dtype=tl.float32)
    for used in range(0, num_used_splits):
        weight = tl.exp2(tl.load(partial_lse_ptr + first_row + used) - lse_max)
        partial = tl.load(
            partial_out_ptr + (first_row + used) * LATENT + dims, mask=dims < LATENT, other=0.0
        )
        acc += partial * weight
    out = acc / weight_sum
    tl.store(
        out_ptr + token.to(tl.int64) * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < LATENT,
    )


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter runs: any fixed number keeps launches deterministic
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(metadata: AttentionMetadata, num_heads: int, device: torch.device) -> int:
    """How many splits each context is cut into: enough programs to fill the GPU, each with at
    least MIN_KEYS_PER_SPLIT keys of the longest context (a function of shapes only)."""
    programs_wanted = PROGRAMS_PER_SM * _multiprocessor_count(device)
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    by_occupancy = triton.cdiv(programs_wanted, metadata.num_seqs * head_blocks)
    by_length = triton.cdiv(metadata.max_seq_len, MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def mla_decode(
    q: torch.Tensor,  # [T, heads, kv_lora_rank + qk_rope_head_dim]: [q_nope W_UK | q_rope]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, 1, D / 2]
    metadata: AttentionMetadata,  # decode-only: one query token per sequence
    scale: float,
    kv_lora_rank: int,
    splits: int | None = None,  # None: `num_splits`
    out: torch.Tensor | None = None,  # [T, heads, kv_lora_rank], contiguous; None: a new one
) -> torch.Tensor:  # [T, heads, kv_lora_rank], q's dtype
    """Absorbed latent attention of a decode-only batch, read from the paged cache (into `out`
    when given)."""
    num_tokens, num_heads, width = q.shape
    half = layer_cache.shape[-1]
    if layer_cache.shape[0] != 2 or layer_cache.shape[3] != 1 or 2 * half != width:
        raise ValueError(
            f"an MLA cache of one layer is [2, blocks, block_size, 1, {width // 2}] for queries "
            f"of width {width}, got {list(layer_cache.shape)}"
        )
    if layer_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the MLA cache's and the queries' last dimensions must be contiguous")
    rope = width - kv_lora_rank
    num_seqs = metadata.num_seqs
    splits = splits or num_splits(metadata, num_heads, q.device)
    if out is None:
        out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, splits, kv_lora_rank,
                                  dtype=torch.float32, device=q.device)  # fmt: skip
        partial_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32,
                                  device=q.device)  # fmt: skip
    else:
        partial_out = partial_lse = out  # not touched with one split
    fp32 = layer_cache.dtype == torch.float32
    block_n = 16 if fp32 else 32
    options = pdl_options(q.device)
    mla_decode_kernel[(num_seqs, triton.cdiv(num_heads, BLOCK_H), splits)](
        q,
        layer_cache,
        out,
        partial_out,
        partial_lse,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        layer_cache.stride(0),
        layer_cache.stride(1),
        layer_cache.stride(2),
        metadata.block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_SPLITS=splits,
        BLOCK_H=BLOCK_H,
        LATENT=kv_lora_rank,
        LATENT_POW2=max(triton.next_power_of_2(kv_lora_rank), 16),
        ROPE=rope,
        ROPE_POW2=max(triton.next_power_of_2(rope), 16),
        HALF=half,
        BLOCK_SIZE=layer_cache.shape[2],
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=8 if kv_lora_rank >= 256 else 4,
        num_stages=2,
        **options,
    )
    if splits > 1:
        mla_combine_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_lse,
            metadata.query_start_loc,
            metadata.seq_lens,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            NUM_SPLITS=splits,
            SPLITS_POW2=triton.next_power_of_2(splits),
            LATENT=kv_lora_rank,
            LATENT_POW2=triton.next_power_of_2(kv_lora_rank),
            BLOCK_N=block_n,
            num_warps=4,
            **options,
        )
    return out


@triton.jit
def store_latents_kernel(
    latents_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_latents,
    stride_cache_plane,
    stride_cache_block,
    stride_cache_token,
    HALF: tl.constexpr,
    HALF_POW2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        slot = slot.to(tl.int64)
        dims = tl.arange(0, HALF_POW2)
        valid = dims < HALF
        row = latents_ptr + token.to(tl.int64) * stride_latents
        target = (
            cache_ptr
            + (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_token
        )
        first = tl.load(row + dims, mask=valid)
        second = tl.load(row + HALF + dims, mask=valid)
        tl.store(target + dims, first.to(cache_ptr.dtype.element_ty), mask=valid)
        tl.store(
            target + stride_cache_plane + dims, second.to(cache_ptr.dtype.element_ty), mask=valid
        )


def store_latents(
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, 1, D / 2]
    latents: torch.Tensor,  # [T, D]
    slot_mapping: torch.Tensor,  # [T]; -1: not stored
) -> None:
    """`tandem.models.layers.mla.store_latents` in one kernel, without its host sync."""
    half = layer_cache.shape[-1]
    if latents.stride(-1) != 1 or layer_cache.stride(-1) != 1:
        raise ValueError("the latents' and the MLA cache's last dimensions must be contiguous")
    store_latents_kernel[(latents.shape[0],)](
        latents,
        layer_cache,
        slot_mapping,
        latents.stride(0),
        layer_cache.stride(0),
        layer_cache.stride(1),
        layer_cache.stride(2),
        HALF=half,
        HALF_POW2=triton.next_power_of_2(half),
        BLOCK_SIZE=layer_cache.shape[2],
    )
