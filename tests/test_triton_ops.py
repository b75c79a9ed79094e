"""The fused Triton kernels against the model's torch reference: on CPU through Triton's
interpreter (in a subprocess, so the setting does not leak), and on a GPU in bfloat16."""

from __future__ import annotations

import textwrap

import pytest
import torch

from triton_interpreter import run_in_interpreter

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from tandem.models import triton_ops as T
    from tandem.models.config import ModelConfig
    from tandem.attention.torch_backend import TorchAttentionBackend
    from tandem.models.layers.norm import RMSNorm
    from tandem.models.layers.rotary import RotaryEmbedding, apply_rotary

    @torch.inference_mode()
    def run(device, dtype, atol):
        torch.manual_seed(0)
        x = torch.randn(7, 96, device=device, dtype=dtype)
        residual = torch.randn_like(x)
        norm = RMSNorm(96, 1e-6).to(device=device, dtype=dtype)
        norm.weight.data.normal_()
        torch.testing.assert_close(T.rms_norm(x, norm.weight, 1e-6), norm(x), atol=atol, rtol=atol)
        updated = residual.clone()
        out = T.add_rms_norm(x, updated, norm.weight, 1e-6)
        expected_out, expected_residual = norm.add_forward(x, residual.clone())
        torch.testing.assert_close(updated, expected_residual, atol=atol, rtol=atol)
        torch.testing.assert_close(out, expected_out, atol=atol, rtol=atol)

        config = ModelConfig.from_hf(dict(
            vocab_size=8, hidden_size=96, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0))
        rotary = RotaryEmbedding(config).to(device)
        positions = torch.tensor([0, 1, 5, 17, 100, 1000, 4095], device=device)
        slots = torch.tensor([3, 0, -1, 9, 14, 4, 7], device=device)  # -1: not stored
        q_norm, k_norm = RMSNorm(16, 1e-6).to(device, dtype), RMSNorm(16, 1e-6).to(device, dtype)
        q_norm.weight.data.normal_()
        k_norm.weight.data.normal_()
        for with_norm in (False, True):
            qkv = torch.randn(7, (6 + 2 + 2) * 16, device=device, dtype=dtype)
            q, k, v = (part.reshape(7, -1, 16) for part in qkv.split([96, 32, 32], dim=-1))
            if with_norm:
                q, k = q_norm(q), k_norm(k)
            cos_sin = rotary.cos_sin(positions)
            expected_q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
            caches = torch.randn(2, 4, 4, 2, 16, device=device, dtype=dtype)  # 4 blocks of 4
            expected_caches = caches.clone()
            TorchAttentionBackend().store_kv(k, v, expected_caches[0], expected_caches[1], slots)
            norm = (q_norm.weight, k_norm.weight, 1e-6) if with_norm else None
            out = T.qk_norm_rotary_store(
                qkv, 6, 2, positions, rotary.inv_freq, norm, caches[0], caches[1], slots)
            torch.testing.assert_close(out, expected_q, atol=atol, rtol=atol)
            assert out.data_ptr() == qkv.data_ptr()  # rotated in place
            torch.testing.assert_close(caches, expected_caches, atol=atol, rtol=atol)

        for rows, n, k, bias in ((1, 64, 512, False), (3, 50, 300, True), (4, 36, 2048, True)):
            x = torch.randn(rows, k, device=device, dtype=dtype)
            weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
            b = torch.randn(n, device=device, dtype=dtype) if bias else None
            expected = torch.nn.functional.linear(x.float(), weight.float(),
                                                  None if b is None else b.float()).to(dtype)
            torch.testing.assert_close(T.small_batch_linear(x, weight, b), expected,
                                       atol=atol, rtol=atol)

        gate_up = torch.randn(7, 2 * 3000, device=device, dtype=dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(T.silu_and_mul(gate_up), expected, atol=atol, rtol=atol)
    """
)


def test_fused_kernels_match_torch_in_the_interpreter():
    result = run_in_interpreter(CHECK + "\nrun('cpu', torch.float32, 1e-5)\n")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.cuda
def test_fused_kernels_match_torch_on_gpu():
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["run"]("cuda", torch.float32, 1e-5)
    namespace["run"]("cuda", torch.bfloat16, 2e-2)


FUSED_SUM_ONE_RANK = textwrap.dedent(
    """
    import torch
    from tandem.distributed import fused_all_reduce as F
    from tandem.models.triton_ops import add_rms_norm

    torch.manual_seed(0)
    width, most_rows = 64, 2 * F.PROGRAMS + 5
    _, bits, empty = F.BITS[2]
    buffer = torch.full((2 * most_rows * width,), empty, dtype=torch.int16)
    buffers = torch.tensor([buffer.data_ptr()], dtype=torch.int64)
    calls = torch.zeros(F.PROGRAMS, dtype=torch.int64)
    weight = torch.rand(width).bfloat16()
    # up to three rows a program, then one row, then two for the first program; both slot sets
    for call, rows in enumerate([most_rows, 1, F.PROGRAMS + 1]):
        x = torch.randn(rows, width).bfloat16()
        x[0, 0] = -0.0  # EMPTY's bits: goes as a positive zero
        residual = torch.randn(rows, width).bfloat16()
        expected_residual = residual.clone()
        out = torch.empty_like(x)
        F._all_reduce_add_rms_norm_kernel[(F.PROGRAMS,)](
            buffers, calls, x, residual, weight, out, rows, width, width, width, 1e-5, 0,
            most_rows * width, RANKS=1, PROGRAMS=F.PROGRAMS, BITS=bits, EMPTY=empty, BLOCK=64,
            USE_PDL=False)
        x[0, 0] = 0.0
        expected = add_rms_norm(x, expected_residual, weight, 1e-5)
        assert torch.equal(residual, expected_residual), call
        assert torch.equal(out, expected), call
        assert (buffer == empty).all(), call  # every slot read was emptied
        assert (calls == call + 1).all()
    """
)


def test_fused_sum_kernel_on_one_rank_in_the_interpreter():
    """The fused sum, add and norm's kernel with its one rank's buffer on the host: the numbers
    of add_rms_norm (with the interpreter's rounding on both sides), a negative zero taken as a
    zero, and every slot EMPTY again after each call. Two ranks: test_tensor_parallel_cuda.py."""
    result = run_in_interpreter(FUSED_SUM_ONE_RANK)
    assert result.returncode == 0, result.stderr[-3000:]
