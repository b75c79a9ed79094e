"""Gated activations: the input's two halves [gate | up] -> act(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers import fused_kernels


class SiluAndMul(nn.Module):
    """[T, 2 * d] -> [T, d]: silu(gate) * up (SwiGLU)."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_kernels().silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
