"""The fused Triton kernels against the model's torch reference: on CPU through Triton's
interpreter (in a subprocess, so the setting does not leak), and on a GPU in bfloat16."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from tandem.models import triton_ops as T
    from tandem.models.config import ModelConfig
    from tandem.models.llama import RMSNorm, RotaryEmbedding, apply_rotary

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
        qkv = torch.randn(7, (6 + 2 + 2) * 16, device=device, dtype=dtype)
        q = qkv[:, :96].reshape(7, 6, 16)  # a strided view, as in the model
        expected = apply_rotary(q.clone(), *rotary.cos_sin(positions))
        T.rotary_(q, positions, rotary.inv_freq)
        torch.testing.assert_close(qkv[:, :96].reshape(7, 6, 16), expected, atol=atol, rtol=atol)

        gate_up = torch.randn(7, 2 * 3000, device=device, dtype=dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(T.silu_and_mul(gate_up), expected, atol=atol, rtol=atol)
    """
)


def test_fused_kernels_match_torch_in_the_interpreter():
    source = Path(__file__).resolve().parent.parent / "src"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(source))
    script = CHECK + "\nrun('cpu', torch.float32, 1e-5)\n"
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.cuda
def test_fused_kernels_match_torch_on_gpu():
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["run"]("cuda", torch.float32, 1e-5)
    namespace["run"]("cuda", torch.bfloat16, 2e-2)
