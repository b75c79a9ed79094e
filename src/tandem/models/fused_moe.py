"""The experts of a mixture-of-experts layer on CUDA: a Triton grouped GEMM, one launch per
projection for every expert (the torch path of `tandem.models.layers.moe` is its oracle).

The (token, expert) pairs are sorted by expert once per layer, each expert's run padded to a
whole number of BLOCK_M rows; a program of the GEMM takes BLOCK_M rows of one expert, gathers
their inputs and multiplies by that expert's weights:

    pair p = token * k + j          (the token's j-th expert)
    sorted_pairs   [max_rows]       pairs grouped by expert, each group padded with `num_pairs`
    block_experts  [max_rows / BLOCK_M]   the local expert of each block (-1: past the last)

    1. gate_up[p] = x[p // k] @ gate_up_proj[e].T           [pairs, 2 * rows]
    2. act[p]     = silu(gate) * up                          [pairs, rows]
    3. down[p]    = weight[p] * (act[p] @ down_proj[e].T)    [pairs, hidden], fp32
    4. out[t]     = sum_j down[t * k + j]

Everything stays on the GPU (no host sync, fixed shapes for a given number of tokens): CUDA
graphs capture it. The grid covers the most blocks any routing can need (pairs + experts *
(BLOCK_M - 1) rows); the blocks past the last expert's return at once. Pairs whose expert is
another rank's (expert parallelism) sort past every local expert and are never computed: their
rows of `down` stay zero.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.models import triton_ops

# Up to this many pairs (decode) one Triton program sorts them (one launch instead of ~25 torch
# kernels, which took 80 us of a 130 us layer at batch 1); more sort with torch.
MAX_PAIRS_SORTED_IN_ONE_PROGRAM = 1024
SORT_CHUNK = 128


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(num_pairs: int, num_local: int, dtype: torch.dtype) -> GemmConfig:
    """Tiles by the mean pairs per expert, the fastest measured on an H100 for Qwen3-30B-A3B's
    and Mixtral-8x7B's experts (benchmarks/moe_experts.py)."""
    per_expert = num_pairs / num_local
    if dtype == torch.float32:  # exact fp32 products (tests): tiles that fit shared memory
        return GemmConfig(16 if per_expert <= 4 else 64, 64, 32, 4, 3)
    if per_expert <= 4:  # decode: a few rows per expert, bound by reading its weights
        return GemmConfig(16, 64, 128, 4, 4)
    if per_expert < 128:
        return GemmConfig(32, 64, 128, 4, 4)
    return GemmConfig(128, 256, 64, 8, 3)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of a, K]
    b_ptr,  # [experts, N, K]
    c_ptr,  # [num_pairs, N]
    pair_weights_ptr,  # [num_pairs] float32 (MUL_WEIGHTS only)
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    a_row_divisor,  # a's row of pair p: p // a_row_divisor (top_k: x's token; 1: the pair's)
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    MUL_WEIGHTS: tl.constexpr,
    IEEE: tl.constexpr,  # exact fp32 products (float32 inputs)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + block_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    columns = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // a_row_divisor)[:, None] * stride_am + inner[None, :]
    b_ptrs = b_ptr + expert * stride_be + columns[None, :] * stride_bn + inner[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        in_k = inner + start < K
        a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=in_k[:, None] & (columns[None, :] < N), other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHTS:
        acc *= tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + columns[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (columns[None, :] < N))


@triton.jit
def _sort_pairs_kernel(
    local_ids_ptr,  # [num_pairs]
    sorted_pairs_ptr,  # [max_rows + 1], filled with num_pairs
    block_experts_ptr,  # [num_blocks]
    num_pairs,
    num_local,
    num_blocks,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,  # a power of two above num_local (bin num_local: other ranks')
    CHUNK: tl.constexpr,
):
    """One program: count the pairs per expert, lay the padded runs out, then place each pair
    after the earlier pairs of its expert (stable), CHUNK pairs at a time."""
    bins = tl.arange(0, NUM_BINS)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(local_ids_ptr + start + lanes, mask=start + lanes < num_pairs,
                      other=num_local).to(tl.int32)  # fmt: skip
        counts += tl.sum((ids[:, None] == bins[None, :]).to(tl.int32), axis=0)
    padded = tl.where(bins < num_local, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    # a block's expert: the number of experts whose run ends at or before its first row
    for first in range(0, num_blocks, CHUNK):
        blocks = first + lanes
        expert = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        expert = tl.where(expert < num_local, expert, -1)
        tl.store(block_experts_ptr + blocks, expert.to(tl.int64), mask=blocks < num_blocks)
    offsets = ends - padded  # where each expert's next pair goes
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        in_range = pairs < num_pairs
        ids = tl.load(local_ids_ptr + pairs, mask=in_range, other=num_local).to(tl.int32)
        one_hot = ids[:, None] == bins[None, :]
        earlier_same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
        destination = tl.sum(tl.where(one_hot, offsets[None, :], 0), axis=1) + rank
        tl.store(sorted_pairs_ptr + destination, pairs.to(tl.int64),
                 mask=in_range & (ids < num_local))  # fmt: skip
        offsets += tl.sum(one_hot.to(tl.int32), axis=0)


def sort_pairs_by_expert(
    local_ids: torch.Tensor,  # [pairs] local expert of each pair; num_local: another rank's
    num_local: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts) as the module's docstring draws them, on the GPU."""
    num_pairs = local_ids.numel()
    device = local_ids.device
    max_rows = num_pairs + num_local * (block_m - 1)
    max_rows = -(-max_rows // block_m) * block_m
    if num_pairs <= MAX_PAIRS_SORTED_IN_ONE_PROGRAM:
        sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.int64, device=device)
        block_experts = torch.empty(max_rows // block_m, dtype=torch.int64, device=device)
        _sort_pairs_kernel[(1,)](
            local_ids, sorted_pairs, block_experts, num_pairs, num_local, block_experts.numel(),
            BLOCK_M=block_m, NUM_BINS=triton.next_power_of_2(num_local + 1), CHUNK=SORT_CHUNK,
            num_warps=8,
        )  # fmt: skip
        return sorted_pairs[:max_rows], block_experts
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, local_ids, torch.ones_like(local_ids))
    counts = counts[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    order = local_ids.argsort(stable=True)
    sorted_ids = local_ids[order]
    held = sorted_ids < num_local
    expert_of_row = sorted_ids.clamp(max=num_local - 1)
    unpadded_starts = counts.cumsum(0) - counts
    rank_in_expert = torch.arange(num_pairs, device=device) - unpadded_starts[expert_of_row]
    destination = torch.where(held, padded_starts[expert_of_row] + rank_in_expert, max_rows)
    sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, destination, order)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_local, block_experts, -1)
    return sorted_pairs[:max_rows], block_experts


def _grouped_gemm(
    a: torch.Tensor,
    weights: torch.Tensor,  # [experts, N, K]
    out: torch.Tensor,  # [pairs, N]
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    a_row_divisor: int,
    config: GemmConfig,
    pair_weights: torch.Tensor | None = None,
) -> None:
    _, n, k = weights.shape
    grid = (block_experts.numel(), triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a, weights, out, pair_weights if pair_weights is not None else out, sorted_pairs,
        block_experts, out.shape[0], n, k, a_row_divisor, a.stride(0), weights.stride(0),
        weights.stride(1), out.stride(0),
        MUL_WEIGHTS=pair_weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,  # [T, hidden]
    gate_up: torch.Tensor,  # [local experts, 2 * rows, hidden]
    down: torch.Tensor,  # [local experts, hidden, rows]
    weights: torch.Tensor,  # [T, k] float32
    expert_ids: torch.Tensor,  # [T, k] global expert ids
    first_expert: int,
    all_experts_local: bool,  # no pair to skip (no expert parallelism)
) -> torch.Tensor:  # [T, hidden]: the local experts' weighted sum
    num_tokens, top_k = expert_ids.shape
    num_local, hidden = gate_up.shape[0], x.shape[1]
    rows = down.shape[2]
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    local_ids = expert_ids.flatten() - first_expert
    local_ids = torch.where((local_ids >= 0) & (local_ids < num_local), local_ids, num_local)
    num_pairs = num_tokens * top_k
    config = gemm_config(num_pairs, num_local, x.dtype)
    sorted_pairs, block_experts = sort_pairs_by_expert(local_ids, num_local, config.block_m)
    gate_up_out = torch.empty(num_pairs, 2 * rows, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, gate_up_out, sorted_pairs, block_experts, top_k, config)
    activated = triton_ops.silu_and_mul(gate_up_out)
    new_down_out = torch.empty if all_experts_local else torch.zeros  # skipped pairs add 0
    down_out = new_down_out(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm(
        activated, down, down_out, sorted_pairs, block_experts, 1, config,
        weights.flatten().contiguous().float(),
    )  # fmt: skip
    return down_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
