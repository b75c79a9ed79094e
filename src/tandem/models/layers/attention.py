"""Attention over the paged KV cache, the stage of a layer that reads other tokens.

A decoder's attention runs in two stages, so that a caller can run what lies between two layers'
attention apart from the attention itself (piecewise CUDA graphs): the model's own projection
(q/k/v, norms, rotary and, with the fused kernels, the K/V store) and `PagedAttention.attend`
over the cache, through the attention backend. `ForwardContext` holds what every layer's
projection shares in one forward pass.

    layer_cache[0 = key | 1 = value, block_id, offset_in_block, kv_head, head_dim]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """What every layer's attention inputs share in one forward pass."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor  # where the fused kernel stores each token's K/V (-1: nowhere)
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None  # unfused path only


class PagedAttention(nn.Module):
    """fused: the projection stored K/V in the cache already and hands over (q,) alone; else it
    hands over (q, k, v), which the backend stores and attends over."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        fused: bool,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.backend = backend
        self.fused = fused
        self.scale = head_dim**-0.5

    def attend(
        self,
        projected: tuple[torch.Tensor, ...],
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, heads * head_dim], before the output projection; written into `out` ([T, heads,
        head_dim]) when given."""
        k_cache, v_cache = layer_cache[0], layer_cache[1]
        if self.fused:
            (q,) = projected
            attended = self.backend.attend(q, k_cache, v_cache, metadata, self.scale, out)
        else:
            attended = self.backend.forward(*projected, k_cache, v_cache, metadata, self.scale)
            if out is not None:
                attended = out.copy_(attended)
        return attended.reshape(attended.shape[0], self.num_heads * self.head_dim)
