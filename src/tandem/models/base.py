"""The model protocol: what the runner, the CUDA graphs and the loader ask of a decoder.

A model is a torch module built as `cls(config, backend, fused_ops, tp)` with every parameter
named as its checkpoint's (two packed projections aside, filled by `load_weights`); `tp` is its
rank's tensor-parallel group, and a rank holds only its shard of each split parameter. Its
forward pass takes a flat batch of tokens (no padding) with their positions and attention
metadata, writes their K/V into the paged cache and returns the final hidden states;
`compute_logits` projects only the rows the caller asks for (on rank 0; the other ranks take
part and get None). The staged forward (embed, then per layer attention_inputs -> attention ->
layer_output) is the same pass in pieces: everything but `attention` depends on the number of
tokens alone, which is what lets piecewise CUDA graphs capture it.

    kv_cache[layer, 0 = key | 1 = value, block_id, offset_in_block, kv_head, head_dim]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.distributed.group import TensorParallelGroup
from tandem.models.config import ModelConfig
from tandem.models.layers.attention import ForwardContext


@dataclass(frozen=True)
class KVCacheLayout:
    """One token's KV in every layer on this rank: [num_layers, 2, num_kv_heads, head_dim], its
    KV heads being the model's [kv_head_start, kv_head_start + num_kv_heads)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_head_start: int = 0
    # latent attention (DeepSeek): (kv_lora_rank, qk_rope_head_dim), one token's latent vector
    # split in halves over the two planes (see tandem.models.layers.mla); None: keys and values
    latent: tuple[int, int] | None = None


class CausalLM(Protocol):
    config: ModelConfig
    backend: AttentionBackend
    fused_ops: bool  # built with the fused Triton kernels (CUDA only)
    tp: TensorParallelGroup  # this rank's tensor-parallel group
    # its staged forward fits the piecewise CUDA graphs' buffers (queries and attention output
    # [T, heads, head_dim]); latent attention's do not
    piecewise_capturable: bool

    @property
    def dtype(self) -> torch.dtype: ...

    def kv_cache_layout(self) -> KVCacheLayout: ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,  # once layer i's K/V is in the cache
    ) -> torch.Tensor: ...  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...  # [rows, vocab]

    def forward_context(
        self, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> ForwardContext: ...

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attention_inputs(
        self, index: int, hidden: torch.Tensor, kv_cache: torch.Tensor, context: ForwardContext
    ) -> tuple[torch.Tensor, ...]: ...

    def attention(
        self,
        index: int,
        projected: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def layer_output(
        self, index: int, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...
