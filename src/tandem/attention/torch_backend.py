"""The reference attention backend: plain torch, CPU and CUDA, and the oracle for fast kernels.

It gathers each sequence's context out of the paged cache into a padded batch
[B, max_seq_len, kv_heads, head_dim], pads the queries to [B, max_query_len, heads, head_dim],
and runs one masked scaled-dot-product attention. Correct for any mix of prefill chunks, prefix
hits and decodes; not tuned for speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_seqs = metadata.num_seqs
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        device = q.device

        # Context of every sequence, padded: [B, max_blocks * block_size, kv_heads, head_dim].
        max_blocks = (metadata.max_seq_len + block_size - 1) // block_size
        tables = metadata.block_tables[:, :max_blocks].long()
        keys = k_cache[tables].reshape(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
        values = v_cache[tables].reshape(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)

        # Queries, padded: [B, max_query_len, heads, head_dim].
        starts = metadata.query_start_loc[:-1].long()
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
        index_in_seq = torch.arange(num_tokens, device=device) - starts[seq_of_token]
        padded_q = q.new_zeros(num_seqs, metadata.max_query_len, num_heads, head_dim)
        padded_q[seq_of_token, index_in_seq] = q

        # Causal mask with each sequence's offset: query i sees keys 0 ..= seq_len - q_len + i.
        seq_lens = metadata.seq_lens.long()
        query_pos = (seq_lens - query_lens)[:, None] + torch.arange(
            metadata.max_query_len, device=device
        )
        key_pos = torch.arange(keys.shape[1], device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, max_q, max_k]

        attended = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2).to(keys.dtype),  # [B, heads, max_q, head_dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [B, heads, max_q, head_dim]
        result = attended.transpose(1, 2)[seq_of_token, index_in_seq].to(q.dtype)
        return result if out is None else out.copy_(result)
