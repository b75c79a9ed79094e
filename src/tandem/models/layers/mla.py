"""DeepSeek's multi-head latent attention (MLA) over its compressed, paged KV cache.

Per token, the keys and values of every head come from one latent vector:

    kv_a_proj_with_mqa(x) = [c (kv_lora_rank) | k_rope (qk_rope_head_dim)]   c normed, k_rope roped
    kv_b_proj(c)          = per head [k_nope (qk_nope_head_dim) | v (v_head_dim)]
    q (per head)          = [q_nope | q_rope]   from q_proj(x), or q_b_proj(norm(q_a_proj(x)))
    key (per head)        = [k_nope | k_rope]   k_rope shared by the heads

The cache keeps only [c | k_rope] (D = kv_lora_rank + qk_rope_head_dim values a token, one
"KV head" that every rank holds whole), in the model-wide [2, blocks, block_size, heads, dim]
layout of one layer: the vector's first half in plane 0, its second in plane 1 (kv heads 1,
head_dim D / 2), so the KV data planes and the tensor-parallel relay move it as any cache.

Attention either decompresses each sequence's gathered latents into per-head keys and values
(batches with a prompt chunk: the cheaper form when queries are many), or absorbs the
up-projection into the queries (decode-only batches): q_nope W_UK attends over the latents as
one shared KV head, and the result leaves through W_UV. Both are the same function (a test
holds them equal). On CUDA with Triton, kernels read the latents in place and store them
(`tandem.attention.triton_mla`, no host sync); elsewhere the torch path gathers them (the oracle).

Rotary embedding touches the rope parts only, on DeepSeek's interleaved pairs (or on halves
where a V3 config sets rope_interleave false), with YaRN scaling: its attention factor scales
cos and sin, and mscale_all_dim scales the softmax.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention.base import AttentionMetadata
from tandem.distributed.group import TensorParallelGroup
from tandem.models.config import MLAConfig, ModelConfig
from tandem.models.layers.attention import ForwardContext
from tandem.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import apply_rotary


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's inverse frequencies: interpolated (divided by the factor) below the slow
    boundary's frequency, kept above the fast one, a linear ramp between."""
    factor = scaling["factor"]
    original_len = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolated = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kept = 1 - ramp
    return extrapolated / factor * (1 - kept) + extrapolated * kept


class MLARotary(nn.Module):
    """The rope parts' angles (default or YaRN), and the softmax scale that goes with them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla = config.mla
        dim = mla.qk_rope_head_dim
        self.attention_factor = 1.0
        self.softmax_scale = (mla.qk_nope_head_dim + dim) ** -0.5
        scaling = dict(config.rope_scaling or ())
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind is None:
            inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2).float() / dim)
        elif kind == "yarn":
            if scaling.get("factor") is None:
                scaling["factor"] = (
                    config.max_position_embeddings / scaling["original_max_position_embeddings"]
                )
            inv_freq = yarn_inv_freq(dim, config.rope_theta, scaling)
            factor, mscale = scaling["factor"], scaling.get("mscale")
            mscale_all_dim = scaling.get("mscale_all_dim")
            self.attention_factor = scaling.get("attention_factor") or (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                if mscale and mscale_all_dim
                else yarn_mscale(factor)
            )
            if mscale_all_dim:
                self.softmax_scale *= yarn_mscale(factor, mscale_all_dim) ** 2
        else:
            raise ValueError(f"rope scaling {kind!r} is not supported for DeepSeek; use 'yarn'")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token angles: two [T, 1, qk_rope_head_dim / 2] tensors, YaRN's factor in them."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        factor = self.attention_factor
        return (freqs.cos() * factor)[:, None, :], (freqs.sin() * factor)[:, None, :]


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], interleaved: bool) -> torch.Tensor:
    """x [T, heads, rope dim] rotated; interleaved pairs (x0, x1), (x2, x3), ... come out as
    [evens | odds], the same permutation for q and k, which leaves their products as they are."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rotary(x, *cos_sin)


def store_latents(
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, 1, D / 2]
    latents: torch.Tensor,  # [T, D]
    slot_mapping: torch.Tensor,  # [T]; -1: not stored
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        latents, slot_mapping = latents[keep], slot_mapping[keep]
    half = layer_cache.shape[-1]
    planes = layer_cache.view(2, -1, half)  # [2, slots, D / 2]
    latents = latents.to(layer_cache.dtype)
    planes[0].index_copy_(0, slot_mapping, latents[:, :half])
    planes[1].index_copy_(0, slot_mapping, latents[:, half:])


def gather_latents(layer_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """Every sequence's context, padded: [B, max_blocks * block_size, D]."""
    block_size = layer_cache.shape[2]
    max_blocks = -(-metadata.max_seq_len // block_size)
    tables = metadata.block_tables[:, :max_blocks].long()
    halves = layer_cache[:, tables]  # [2, B, max_blocks, block_size, 1, D / 2]
    return torch.cat((halves[0], halves[1]), dim=-1).reshape(
        tables.shape[0], -1, 2 * halves.shape[-1]
    )


def padded_attention(
    q: torch.Tensor,  # [T, heads, q dim]
    keys: torch.Tensor,  # [B, heads or 1, context, q dim]
    values: torch.Tensor,  # [B, heads or 1, context, v dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads, v dim]
    """Causal attention of each sequence's queries over its gathered context (the layout of
    `tandem.attention.base`: query i of a sequence sees context positions up to its own)."""
    num_tokens, num_heads, _ = q.shape
    num_seqs, device = metadata.num_seqs, q.device
    starts = metadata.query_start_loc[:-1].long()
    query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
    index_in_seq = torch.arange(num_tokens, device=device) - starts[seq_of_token]
    padded_q = q.new_zeros(num_seqs, metadata.max_query_len, num_heads, q.shape[-1])
    padded_q[seq_of_token, index_in_seq] = q
    query_pos = (metadata.seq_lens.long() - query_lens)[:, None] + torch.arange(
        metadata.max_query_len, device=device
    )
    key_pos = torch.arange(keys.shape[2], device=device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, max_q, context]
    attended = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2).to(keys.dtype),
        keys.expand(num_seqs, num_heads, *keys.shape[2:]),
        values.expand(num_seqs, num_heads, *values.shape[2:]),
        attn_mask=mask[:, None],
        scale=scale,
    )  # [B, heads, max_q, v dim]
    return attended.transpose(1, 2)[seq_of_token, index_in_seq].to(q.dtype)


def latent_attention(
    queries: torch.Tensor,  # [T, heads, D]: [q_nope W_UK | q_rope]
    latents: torch.Tensor,  # [B, context, D], gathered
    metadata: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [T, heads, kv_lora_rank]
    """The absorbed form's attention in torch: the latents as one shared KV head, their first
    kv_lora_rank values as its values."""
    keys = latents[:, None]  # [B, 1, context, D]
    return padded_attention(queries, keys, keys[..., :kv_lora_rank], metadata, scale)


@functools.cache
def paged_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., None]] | None:
    """The Triton kernels of the absorbed form and of the latents' store (`triton_mla`'s
    mla_decode and store_latents), None without Triton."""
    try:
        from tandem.attention import triton_mla
    except ImportError:
        return None
    return triton_mla.mla_decode, triton_mla.store_latents


class MultiHeadLatentAttention(nn.Module):
    """One layer's MLA; this rank's heads under tensor parallelism (q/q_b and kv_b_proj split by
    head, o_proj row-parallel; q_a_proj and kv_a_proj_with_mqa replicated: the latent is whole
    on every rank)."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        mla: MLAConfig = config.mla
        self.mla = mla
        hidden, heads, eps = config.hidden_size, config.num_heads, config.rms_norm_eps
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        replicated = TensorParallelGroup.single()
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear.even(hidden, heads * self.qk_head_dim, tp=tp)
        else:
            rank = mla.q_lora_rank
            self.q_a_proj = ColumnParallelLinear.even(hidden, rank, bias, tp=replicated)
            self.q_a_layernorm = RMSNorm(rank, eps)
            self.q_b_proj = ColumnParallelLinear.even(rank, heads * self.qk_head_dim, tp=tp)
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim
        self.kv_a_proj_with_mqa = ColumnParallelLinear.even(hidden, latent, bias, tp=replicated)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        kv_b_rows = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear.even(mla.kv_lora_rank, kv_b_rows, tp=tp)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias, tp=tp)
        self.num_heads = heads // tp.size  # this rank's

    def project(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        context: ForwardContext,
        layer_cache: torch.Tensor,
    ) -> tuple[torch.Tensor]:
        """(q [T, heads, qk_nope + qk_rope],), the tokens' latents stored in the cache."""
        mla = self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(hidden.shape[0], self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        k_rope = rotate(k_rope[:, None, :], context.cos_sin, mla.rope_interleave)[:, 0]
        q_rope = rotate(q_rope, context.cos_sin, mla.rope_interleave)
        latents = torch.cat((self.kv_a_layernorm(latent), k_rope), dim=-1)
        kernels = paged_kernels() if layer_cache.is_cuda else None
        store = store_latents if kernels is None else kernels[1]  # the kernel: no host sync
        store(layer_cache, latents, context.slot_mapping)
        return (torch.cat((q_nope, q_rope), dim=-1),)

    def attend(
        self, q: torch.Tensor, layer_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """[T, heads * v_head_dim], before o_proj."""
        if metadata.is_decode_only:
            attended = self.attend_absorbed(q, layer_cache, metadata, scale)
        else:
            latents = gather_latents(layer_cache, metadata)
            attended = self.attend_decompressed(q, latents, metadata, scale)
        return attended.reshape(q.shape[0], -1)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, qk_nope, kv_lora_rank], W_UV [heads, v_head_dim, kv_lora_rank])."""
        mla = self.mla
        weight = self.kv_b_proj.weight.view(self.num_heads, -1, mla.kv_lora_rank)
        return weight.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)

    def attend_decompressed(
        self, q: torch.Tensor, latents: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Per-head keys and values from the latents: [T, heads, v_head_dim]."""
        mla = self.mla
        num_seqs, context = latents.shape[:2]
        latent, k_rope = latents.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(num_seqs, context, self.num_heads, -1)
        k_nope, values = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_rope = k_rope[:, :, None, :].expand(-1, -1, self.num_heads, -1)
        keys = torch.cat((k_nope, k_rope), dim=-1)  # [B, context, heads, qk head dim]
        return padded_attention(q, keys.transpose(1, 2), values.transpose(1, 2), metadata, scale)

    def attend_absorbed(
        self, q: torch.Tensor, layer_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """W_UK folded into the queries, W_UV applied after: [T, heads, v_head_dim]; one query
        token per sequence (decode-only batches)."""
        mla = self.mla
        w_uk, w_uv = self.up_projections()
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        queries = torch.cat((torch.einsum("thn,hnc->thc", q_nope, w_uk), q_rope), dim=-1)
        kernels = paged_kernels() if layer_cache.is_cuda else None
        if kernels is not None:
            attended = kernels[0](queries, layer_cache, metadata, scale, mla.kv_lora_rank)
        else:
            latents = gather_latents(layer_cache, metadata)
            attended = latent_attention(queries, latents, metadata, scale, mla.kv_lora_rank)
        return torch.einsum("thc,hvc->thv", attended, w_uv)
