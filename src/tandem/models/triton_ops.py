"""Fused Triton kernels for the decoder's element-wise work on CUDA.

Unfused, RMSNorm, rotary embedding and SiLU-and-multiply are a dozen small kernels each; at
decode time (a few tokens) their launches, not their bytes, cost the time. Each kernel here does
one of them in one pass, in fp32, rounding where the torch reference rounds, so both give the
same numbers up to the order of fp32 sums:

    add_rms_norm   residual = x + residual (rounded to x's dtype); out = w * rms_norm(residual)
    rms_norm       out = w * rms_norm(x)            (rows of any width up to 16384)
    silu_and_mul   out = silu(gate) * up            (gate_up = [gate | up] along the last dim)
    qk_norm_rotary_store   on a fused qkv row: q (and k) RMSNormed per head when the model has
                   q/k norms, both rotated by position * inv_freq (neox halves), q written back
                   in place, k and v stored in the paged KV cache at the token's slot (one
                   launch for what was up to seven)
    small_batch_linear   x @ w.T (+ bias) for a few rows: a matrix-vector kernel that streams each
                   weight row once for all rows (cuBLAS picks split-K kernels with a separate
                   reduction for these shapes, and small ones run far below the copy rate)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.pdl import pdl_options, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    width,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
    values = x.to(tl.float32)
    variance = tl.sum(values * values, axis=0) / width
    normed = (values * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., width] with a contiguous last dim."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    out = torch.empty(rows.shape, dtype=weight.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, rows, weight, out, rows.stride(0), 0, out.stride(0), shape[-1], eps,
            HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(shape[-1]),
            **pdl_options(x.device),
        )  # fmt: skip
    return out.reshape(shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place); returns w * rms_norm(residual). x, residual: [T, width]."""
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0),
            x.shape[-1], eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(x.shape[-1]),
            **pdl_options(x.device),
        )  # fmt: skip
    return out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, width, in_stride, out_stride, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + width + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    num_rows, double = gate_up.shape
    width = double // 2
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(width, block))](
            gate_up,
            out,
            width,
            gate_up.stride(0),
            out.stride(0),
            BLOCK=block,
            **pdl_options(gate_up.device),
        )
    return out


@triton.jit
def _normed_rotated(
    x1, x2, cos, sin, norm_ptr, eps, half, QK_NORM: tl.constexpr, HALF: tl.constexpr
):
    """Per-row RMSNorm (optional) then neox rotation of a head split in halves x1 | x2, rounding
    where the torch reference rounds (normed, weighted, rotated)."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    if QK_NORM:
        variance = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF)
        rstd = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(norm_ptr + half).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + HALF + half).to(tl.float32)[None, :]
        f1 = (w1 * (f1 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        f2 = (w2 * (f2 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    return (f1 * cos - f2 * sin).to(x1.dtype), (f2 * cos + f1 * sin).to(x1.dtype)


@triton.jit
def _qk_norm_rotary_store_kernel(
    qkv_ptr,
    positions_ptr,
    inv_freq_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    qkv_stride,
    eps,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    KV_HEADS_POW2: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.float32)
    half = tl.arange(0, HALF)
    freqs = position * tl.load(inv_freq_ptr + half)
    cos = tl.cos(freqs)[None, :]
    sin = tl.sin(freqs)[None, :]
    row = qkv_ptr + token * qkv_stride

    heads = tl.arange(0, HEADS_POW2)[:, None]
    q_mask = heads < NUM_HEADS
    q_base = row + heads * (2 * HALF) + half[None, :]
    q1, q2 = _normed_rotated(
        tl.load(q_base, mask=q_mask, other=0.0), tl.load(q_base + HALF, mask=q_mask, other=0.0),
        cos, sin, q_norm_ptr, eps, half, QK_NORM, HALF,
    )  # fmt: skip
    tl.store(q_base, q1, mask=q_mask)
    tl.store(q_base + HALF, q2, mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        kv_heads = tl.arange(0, KV_HEADS_POW2)[:, None]
        kv_mask = kv_heads < NUM_KV_HEADS
        k_base = row + NUM_HEADS * 2 * HALF + kv_heads * (2 * HALF) + half[None, :]
        k1, k2 = _normed_rotated(
            tl.load(k_base, mask=kv_mask, other=0.0),
            tl.load(k_base + HALF, mask=kv_mask, other=0.0),
            cos, sin, k_norm_ptr, eps, half, QK_NORM, HALF,
        )  # fmt: skip
        v_base = k_base + NUM_KV_HEADS * 2 * HALF
        v1 = tl.load(v_base, mask=kv_mask, other=0.0)
        v2 = tl.load(v_base + HALF, mask=kv_mask, other=0.0)
        slot = slot.to(tl.int64)
        cache = (
            (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_token
            + kv_heads * stride_cache_head
            + half[None, :]
        )
        dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + cache, k1.to(dtype), mask=kv_mask)
        tl.store(k_cache_ptr + cache + HALF, k2.to(dtype), mask=kv_mask)
        tl.store(v_cache_ptr + cache, v1.to(dtype), mask=kv_mask)
        tl.store(v_cache_ptr + cache + HALF, v2.to(dtype), mask=kv_mask)


def qk_norm_rotary_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * head_dim]: rotates q in place and returns it as a
    [T, heads, head_dim] view; k (rotated) and v go to the caches [blocks, block_size, kv_heads,
    head_dim] at slot_mapping (-1: not stored). qk_norm: (q weight, k weight, eps) or None."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or qkv.stride(1) != 1:
        raise ValueError("qkv rows and the caches' head_dim must be contiguous, caches alike")
    if num_tokens:
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (inv_freq, inv_freq, 0.0)
        _qk_norm_rotary_store_kernel[(num_tokens,)](
            qkv, positions, inv_freq, q_weight, k_weight, k_cache, v_cache, slot_mapping,
            qkv.stride(0), eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEADS_POW2=triton.next_power_of_2(num_heads),
            KV_HEADS_POW2=triton.next_power_of_2(num_kv_heads), HALF=head_dim // 2,
            BLOCK_SIZE=k_cache.shape[1], QK_NORM=qk_norm is not None,
            **pdl_options(qkv.device),
        )  # fmt: skip
    return qkv[:, : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))


def prefers_small_batch_linear(rows: int, n: int, k: int) -> bool:
    """Where `small_batch_linear` beat cuBLAS on an H200, inside CUDA graphs (docs/benchmarks.md):
    one row, unless the weight is very wide and shallow (a small model's vocabulary projection);
    up to 4 rows for narrow outputs (N <= 2048), which cuBLAS runs far below the copy rate."""
    if rows == 1:
        return k >= 2048 or n <= 16384
    return rows <= 4 and n <= 2048


@triton.jit
def _small_batch_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    N,
    K,
    x_stride,
    out_stride,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p: outputs p * BLOCK_N ... + BLOCK_N of every row; each weight row is read once
    and multiplied into all rows, products summed in fp32 along K at the end."""
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS)
    n_mask = n < N
    row_mask = rows < num_rows
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        if EVEN:
            w = tl.load(w_rows + k[None, :])
            x = tl.load(x_rows + k[None, :], mask=row_mask[:, None], other=0.0)
        else:
            k_mask = k < K
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def small_batch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows <= 4, K] @ weight[N, K].T (+ bias), in x's dtype."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > 4 or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError("small_batch_linear takes up to 4 rows and a contiguous [N, K] weight")
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_n, block_k = 4, 1024  # the best tiles of the sweep, for every shape within 4%
    _small_batch_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, num_rows, n, k,
        x.stride(0), out.stride(0), ROWS=triton.next_power_of_2(num_rows), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN=n % block_n == 0 and k % block_k == 0, HAS_BIAS=bias is not None,
        **pdl_options(x.device),
        num_warps=4, num_stages=1 if num_rows == 1 else 3,
    )  # fmt: skip
    return out
