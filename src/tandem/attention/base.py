"""The attention backend interface and its registry.

A backend computes attention for one flattened batch of query tokens against the paged KV cache.

    KV cache of one layer:  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot of a token:        slot = block_id * block_size + offset_in_block

    sequence b of the batch (B sequences, T query tokens in all):
        its query tokens are q[query_start_loc[b] : query_start_loc[b + 1]]   (query_len_b of them)
        its context is seq_len_b tokens, the last query_len_b of which are the new ones
        query token i of sequence b sits at position  seq_len_b - query_len_b + i  and attends
        (causally) to context positions 0 ..= that position
        context token p of sequence b lives in slot
            block_tables[b, p // block_size] * block_size + p % block_size

`forward` first writes the new tokens' k/v into the cache at `slot_mapping` (a slot of -1 means
"do not store"), then attends; a caller that stored them itself (a fused kernel) calls `attend`.
Backends register by name; `get_backend(name)` imports lazily so an optional dependency (triton)
loads only when chosen.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where the batch's tokens sit in the paged KV cache; shared by every layer of one step."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length (cached + new) per sequence
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int

    @classmethod
    def one_prompt(cls, slot_mapping: torch.Tensor, block_table: torch.Tensor) -> AttentionMetadata:
        """One sequence whose every token is new (no cached prefix): slot_mapping [T] int64,
        block_table [max_blocks_per_seq] int32."""
        num_tokens = slot_mapping.shape[0]
        device = slot_mapping.device
        return cls(
            slot_mapping=slot_mapping,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            block_tables=block_table[None],
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend:
    """Computes `softmax(q k^T * scale) v` over the paged cache (see the module docstring)."""

    name: str = ""
    # Every launch depends on shapes and metadata ints only, never on tensor values (no host
    # sync): a CUDA graph may capture the attention, metadata in static buffers.
    capturable: bool = False

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        self.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self.attend(q, k_cache, v_cache, metadata, scale)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write token t's k/v into the cache at slot_mapping[t]; slots of -1 are skipped."""
        raise NotImplementedError

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q over the contexts already in the cache (the new tokens' k/v stored),
        written into `out` ([T, num_heads, head_dim], contiguous) when given."""
        raise NotImplementedError


_BACKENDS = {
    "torch": "tandem.attention.torch_backend:TorchAttentionBackend",
    "triton": "tandem.attention.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_backends())}"
        )
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()
