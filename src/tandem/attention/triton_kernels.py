"""Triton kernels for attention over the paged KV cache (layout and semantics: attention.base).

    store_kv_kernel           grid (T,): copy token t's k/v rows to slot_mapping[t]; slot -1 skips
    prefill_attention_kernel  grid (query tiles, B, kv_heads): flash attention, causal with offset
    decode_attention_kernel   grid (B, kv_heads, splits): one split of the context (split-K),
                              writing a partial output and its log-sum-exp; the last split of a
                              context to finish combines them by log-sum-exp into the output

GQA: a program owns one kv head and the `GROUP = heads / kv_heads` query heads that read it, so
each K/V tile is loaded once per group. The rows of a program's query tile are (token, head) pairs:

    row r  ->  query token  tile_start + r // GROUP,  query head  kv_head * GROUP + r % GROUP

A prefill tile has BLOCK_M rows, so BLOCK_Q = BLOCK_M // GROUP tokens (rows past BLOCK_Q * GROUP
idle). Keys are gathered one position at a time through the block table, so a key tile may span
pages and any block size works:

    key position p  ->  slot  block_tables[seq, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE

Softmax runs in base 2 (`qk_scale = scale * log2(e)`) with fp32 running max, sum and accumulator.
The prefill key loop has two phases: keys at or before the tile's first query position need no
causal mask; the rest (up to the tile's last query position) are masked per row. Every row sees
key 0, so no row's running max stays -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.pdl import wait_for_previous


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, KV_HEADS_POW2)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < NUM_KV_HEADS)[:, None]
    k = tl.load(
        k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask
    )
    v = tl.load(
        v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask
    )
    slot_offset = (slot // BLOCK_SIZE) * stride_cache_block + (
        slot % BLOCK_SIZE
    ) * stride_cache_token
    cache_offsets = slot_offset + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_key_tile(
    q,
    acc,
    row_sum,
    row_max,
    query_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    key_start,
    key_end,
    head_offset,
    qk_scale,
    stride_cache_block,
    stride_cache_token,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    BOUNDS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of `q` ([rows, HEAD_DIM]) over keys key_start .. key_start+BLOCK_N.

    BOUNDS_MASK drops keys at or past key_end (never read them); CAUSAL_MASK drops, per row, keys
    past that row's query position.
    """
    key_pos = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    if BOUNDS_MASK:
        key_valid = key_pos < key_end
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
    else:
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE)
    slot_offsets = (
        block_ids.to(tl.int64) * stride_cache_block
        + (key_pos % BLOCK_SIZE) * stride_cache_token
        + head_offset
    )
    if BOUNDS_MASK:
        k = tl.load(
            k_cache_ptr + slot_offsets[None, :] + dims[:, None], mask=key_valid[None, :], other=0.0
        )  # [HEAD_DIM, BLOCK_N]
    else:
        k = tl.load(k_cache_ptr + slot_offsets[None, :] + dims[:, None])
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [rows, BLOCK_N], base 2
    if CAUSAL_MASK:
        qk = tl.where(key_pos[None, :] <= query_pos[:, None], qk, float("-inf"))
    if BOUNDS_MASK:
        qk = tl.where(key_valid[None, :], qk, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(qk, 1))
    correction = tl.exp2(row_max - new_max)
    p = tl.exp2(qk - new_max[:, None])
    row_sum = row_sum * correction + tl.sum(p, 1)
    if BOUNDS_MASK:
        v = tl.load(
            v_cache_ptr + slot_offsets[:, None] + dims[None, :], mask=key_valid[:, None], other=0.0
        )  # [BLOCK_N, HEAD_DIM]
    else:
        v = tl.load(v_cache_ptr + slot_offsets[:, None] + dims[None, :])
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_block_tables_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Last query tiles (the most keys) first, so the long programs start early.
    query_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    tile_first_query = query_tile * BLOCK_Q
    if tile_first_query >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query_pos = seq_len - query_len  # position of the sequence's query token 0

    rows = tl.arange(0, BLOCK_M)
    query_index = tile_first_query + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (query_index < query_len)
    query_pos = first_query_pos + query_index
    dims = tl.arange(0, HEAD_DIM)
    token = (query_start + query_index).to(tl.int64)
    q = tl.load(
        q_ptr + (token * stride_q_token + head * stride_q_head)[:, None] + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    head_offset = kv_head * stride_cache_head

    tile_first_pos = first_query_pos + tile_first_query
    tile_end_pos = first_query_pos + tl.minimum(tile_first_query + BLOCK_Q, query_len)
    unmasked_end = (tile_first_pos + 1) // BLOCK_N * BLOCK_N
    for key_start in range(0, unmasked_end, BLOCK_N):
        acc, row_sum, row_max = _attend_key_tile(
            q, acc, row_sum, row_max, query_pos, k_cache_ptr, v_cache_ptr, block_table_ptr,
            key_start, tile_end_pos, head_offset, qk_scale, stride_cache_block,
            stride_cache_token, BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, False, DOT_PRECISION,
        )  # fmt: skip
    for key_start in range(unmasked_end, tile_end_pos, BLOCK_N):
        acc, row_sum, row_max = _attend_key_tile(
            q, acc, row_sum, row_max, query_pos, k_cache_ptr, v_cache_ptr, block_table_ptr,
            key_start, tile_end_pos, head_offset, qk_scale, stride_cache_block,
            stride_cache_token, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, True, DOT_PRECISION,
        )  # fmt: skip

    out = acc / row_sum[:, None]
    tl.store(
        out_ptr + (token * stride_out_token + head * stride_out_head)[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


@triton.jit
def _keys_per_split(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Context positions per decode split: an even share of seq_len, in whole key tiles."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    split_counters_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_block_tables_seq,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Partials: partial_out [B, NUM_HEADS, NUM_SPLITS, HEAD_DIM] (normalised within the split),
    partial_lse [B, NUM_HEADS, NUM_SPLITS] (base 2). Splits past the context write nothing.

    Each context is cut by its own length (`_keys_per_split`), so a short context in a launch
    shaped for long ones still spreads over several programs. The last split of a (sequence, kv
    head) to finish combines the partials into the output: each split counts itself in
    split_counters[seq * kv_heads + kv_head] (release: its partials are written first), and the
    program that brings the count to the number of used splits (acquire) reads them all, in split
    order, and sets the counter back to 0 for the next launch. A context that fits one split
    writes its output directly."""
    wait_for_previous(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq)
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    keys_per_split = _keys_per_split(seq_len, NUM_SPLITS, BLOCK_N)
    key_begin = split * keys_per_split
    if (key_begin >= seq_len) | (query_end == token):
        return
    key_end = tl.minimum(key_begin + keys_per_split, seq_len)

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    token = token.to(tl.int64)
    q = tl.load(
        q_ptr + (token * stride_q_token + head * stride_q_head)[:, None] + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)

    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    head_offset = kv_head * stride_cache_head
    query_pos = tl.zeros([BLOCK_H], dtype=tl.int32)  # unused: no causal mask in decode
    full_end = key_begin + (key_end - key_begin) // BLOCK_N * BLOCK_N
    for key_start in range(key_begin, full_end, BLOCK_N):
        acc, row_sum, row_max = _attend_key_tile(
            q, acc, row_sum, row_max, query_pos, k_cache_ptr, v_cache_ptr, block_table_ptr,
            key_start, key_end, head_offset, qk_scale, stride_cache_block, stride_cache_token,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, False, DOT_PRECISION,
        )  # fmt: skip
    if full_end < key_end:
        acc, row_sum, row_max = _attend_key_tile(
            q, acc, row_sum, row_max, query_pos, k_cache_ptr, v_cache_ptr, block_table_ptr,
            full_end, key_end, head_offset, qk_scale, stride_cache_block, stride_cache_token,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, True, DOT_PRECISION,
        )  # fmt: skip

    out = acc / row_sum[:, None]
    num_used_splits = tl.cdiv(seq_len, keys_per_split)
    out_ptrs = (
        out_ptr + (token * stride_out_token + head * stride_out_head)[:, None] + dims[None, :]
    )
    if NUM_SPLITS == 1:  # decided at compile time: no combining code in this variant
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    elif num_used_splits == 1:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        partial_rows = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
        tl.store(
            partial_out_ptr + (partial_rows + split)[:, None] * HEAD_DIM + dims[None, :],
            out,
            mask=row_valid[:, None],
        )
        tl.store(partial_lse_ptr + partial_rows + split, row_max + tl.log2(row_sum), mask=row_valid)
        tl.debug_barrier()  # every thread's partials are written before the counter's release
        counter = split_counters_ptr + seq * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_used_splits - 1:
            tl.atomic_xchg(counter, 0)
            splits = tl.arange(0, SPLITS_POW2)
            lse = tl.load(
                partial_lse_ptr + partial_rows[:, None] + splits[None, :],
                mask=row_valid[:, None] & (splits < num_used_splits)[None, :],
                other=float("-inf"),
                cache_modifier=".cg",  # written by other programs: not from this SM's L1
            )  # [BLOCK_H, SPLITS_POW2]
            lse_max = tl.max(lse, 1)
            weight_sum = tl.sum(tl.exp2(lse - lse_max[:, None]), 1)
            acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
            for used in range(0, num_used_splits):
                used_rows = partial_rows + used
                split_lse = tl.load(partial_lse_ptr + used_rows, mask=row_valid, other=0.0,
                                    cache_modifier=".cg")  # fmt: skip
                partial = tl.load(
                    partial_out_ptr + used_rows[:, None] * HEAD_DIM + dims[None, :],
                    mask=row_valid[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                acc += partial * tl.exp2(split_lse - lse_max)[:, None]
            out = acc / weight_sum[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
