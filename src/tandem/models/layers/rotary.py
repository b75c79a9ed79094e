"""Rotary position embeddings (RoPE), Hugging Face's (neox) convention: each head's two halves
rotate together. The inverse frequencies take the config's scaling (none, linear, llama3); the
fused kernels read `inv_freq` and rotate inside the q/k projection's epilogue instead.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_scaling is None:
        return inv_freq.float()
    scaling = dict(config.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"rope scaling {kind!r} is not supported; use none, 'linear' or 'llama3'")


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token angles, computed once per forward pass: two [T, 1, head_dim / 2] tensors."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # x: [T, heads, head_dim]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
