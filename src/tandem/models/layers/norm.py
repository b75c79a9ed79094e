"""RMSNorm, alone or fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.layers import fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_kernels().rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the fused kernel updates residual in place."""
        if self.fused:
            return fused_kernels().add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self.forward(residual), residual
