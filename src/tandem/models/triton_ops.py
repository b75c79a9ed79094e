"""Fused Triton kernels for the decoder's element-wise work on CUDA.

Unfused, RMSNorm, rotary embedding and SiLU-and-multiply are a dozen small kernels each; at
decode time (a few tokens) their launches, not their bytes, cost the time. Each kernel here does
one of them in one pass, in fp32, rounding where the torch reference rounds, so both give the
same numbers up to the order of fp32 sums:

    add_rms_norm   residual = x + residual (rounded to x's dtype); out = w * rms_norm(residual)
    rms_norm       out = w * rms_norm(x)            (rows of any width up to 16384)
    rotary         q, k rotated in place by position * inv_freq (neox halves)
    silu_and_mul   out = silu(gate) * up            (gate_up = [gate | up] along the last dim)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
):
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
        )  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    positions_ptr,
    inv_freq_ptr,
    token_stride,
    head_stride,
    num_heads,
    HALF: tl.constexpr,
    HEADS_POW2: tl.constexpr,
):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token).to(tl.float32)
    half = tl.arange(0, HALF)
    freqs = position * tl.load(inv_freq_ptr + half)
    cos = tl.cos(freqs)[None, :]
    sin = tl.sin(freqs)[None, :]
    heads = tl.arange(0, HEADS_POW2)[:, None]
    mask = heads < num_heads
    base = x_ptr + token * token_stride + heads * head_stride + half[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base, (f1 * cos - f2 * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF, (f2 * cos + f1 * sin).to(x1.dtype), mask=mask)


def rotary_(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Rotate x [T, heads, head_dim] in place (a strided view into qkv is fine)."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, positions, inv_freq, x.stride(0), x.stride(1), num_heads,
            HALF=head_dim // 2, HEADS_POW2=triton.next_power_of_2(num_heads),
        )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, width, in_stride, out_stride, BLOCK: tl.constexpr):
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
            gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out
