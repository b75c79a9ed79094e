"""One Llama-family decoder for Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Parameters keep Hugging Face names except two packed projections, filled by `load_weights`:

    self_attn.qkv_proj = [q_proj; k_proj; v_proj]     (rows: heads*d, kv_heads*d, kv_heads*d)
    mlp.gate_up_proj   = [gate_proj; up_proj]          (rows: intermediate, intermediate)

The forward pass takes a flat batch of tokens (no padding) with their positions and attention
metadata, writes their K/V into the paged cache through the attention backend, and returns the
final hidden states; `compute_logits` projects only the rows the caller asks for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.models.config import ModelConfig

try:
    from tandem.models import triton_ops
except ImportError:  # no triton: only the unfused torch path exists
    triton_ops = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return triton_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the fused kernel updates residual in place."""
        if self.fused:
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self.forward(residual), residual


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
    """HF (neox) convention: rotate the two halves of each head."""

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


def linear(x: torch.Tensor, layer: nn.Linear, fused: bool) -> torch.Tensor:
    """layer(x); with the fused kernels, a row or a few (decode) may take the matrix-vector
    kernel, where it is the faster one."""
    if (
        fused
        and x.dtype != torch.float32
        and triton_ops.prefers_small_batch_linear(x.shape[0], *layer.weight.shape)
    ):
        return triton_ops.small_batch_linear(x, layer.weight, layer.bias)
    return layer(x)


@dataclass
class ForwardContext:
    """What every layer's attention inputs share in one forward pass."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor  # where the fused kernel stores each token's K/V (-1: nowhere)
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None  # unfused path only


class Attention(nn.Module):
    """Attention in two stages, so that a caller can run what lies between two layers' attention
    apart from the attention itself (piecewise CUDA graphs): `project` (q/k/v projection, norms,
    rotary and, with the fused kernels, the K/V store) and `attend` (over the paged cache)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, fused: bool) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, fused)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, fused)
        self.qk_norm = config.qk_norm
        self.fused = fused
        self.backend = backend
        self.scale = config.head_dim**-0.5

    def project(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        context: ForwardContext,
    ) -> tuple[torch.Tensor, ...]:
        """With the fused kernels (q,), k and v being in the cache already; else (q, k, v)."""
        num_tokens = hidden.shape[0]
        qkv = linear(hidden, self.qkv_proj, self.fused)
        if self.fused:  # q/k norms, rotary and the K/V store in one kernel
            qk_norm = None
            if self.qk_norm:
                qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            q = triton_ops.qk_norm_rotary_store(
                qkv, self.num_heads, self.num_kv_heads, context.positions, rotary.inv_freq,
                qk_norm, layer_cache[0], layer_cache[1], context.slot_mapping,
            )  # fmt: skip
            return (q,)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *context.cos_sin), apply_rotary(k, *context.cos_sin)
        return q, k, v

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
        return attended.reshape(attended.shape[0], self.q_size)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj, self.fused)
        if self.fused:
            return linear(triton_ops.silu_and_mul(gate_up), self.down_proj, self.fused)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, fused: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.self_attn = Attention(config, backend, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.mlp = MLP(config, fused)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, fused: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, fused) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.rotary = RotaryEmbedding(config)


# HF name fragment -> (packed parameter fragment, shard index)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """fused_ops: use the fused Triton kernels of `triton_ops` (CUDA only)."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, fused_ops: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.fused_ops = fused_ops
        self.backend = backend
        self.model = LlamaModel(config, backend, fused_ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward_context(
        self, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> ForwardContext:
        cos_sin = None if self.fused_ops else self.model.rotary.cos_sin(positions)
        return ForwardContext(positions, slot_mapping, cos_sin)

    # The forward pass in stages: embed, then per layer attention_inputs -> attention ->
    # layer_output. Everything but `attention` depends on the number of tokens alone, which is
    # what lets piecewise CUDA graphs capture it.

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer 0's normed input, the residual stream)."""
        residual = self.model.embed_tokens(input_ids)
        return self.model.layers[0].input_layernorm(residual), residual

    def attention_inputs(
        self, index: int, hidden: torch.Tensor, kv_cache: torch.Tensor, context: ForwardContext
    ) -> tuple[torch.Tensor, ...]:
        attention = self.model.layers[index].self_attn
        return attention.project(hidden, self.model.rotary, kv_cache[index], context)

    def attention(
        self,
        index: int,
        projected: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model.layers[index].self_attn.attend(projected, kv_cache[index], metadata, out)

    def layer_output(
        self, index: int, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index` after its attention (output projection, MLP, residual adds): (the next
        layer's normed input, or the final norm's output after the last layer; the residual)."""
        layers = self.model.layers
        layer = layers[index]
        attn_out = linear(attended, layer.self_attn.o_proj, self.fused_ops)
        hidden, residual = layer.post_attention_layernorm.add_forward(attn_out, residual)
        mlp_out = layer.mlp(hidden)
        is_last = index + 1 == len(layers)
        next_norm = self.model.norm if is_last else layers[index + 1].input_layernorm
        return next_norm.add_forward(mlp_out, residual)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """after_layer(i) runs once layer i's K/V is in the cache."""
        context = self.forward_context(positions, metadata.slot_mapping)
        hidden, residual = self.embed(input_ids)
        for index in range(len(self.model.layers)):
            projected = self.attention_inputs(index, hidden, kv_cache, context)
            attended = self.attention(index, projected, kv_cache, metadata)
            if after_layer is not None:
                after_layer(index)
            hidden, residual = self.layer_output(index, attended, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head, self.fused_ops).float()

    def _shard_sizes(self, packed: str) -> list[int]:
        c = self.config
        if packed == "qkv_proj":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [q, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, packing q/k/v and gate/up. Every parameter must be given."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for fragment, (packed, index) in _PACKED.items():
                if f".{fragment}." in name:
                    target, shard = name.replace(fragment, packed), index
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            if shard is None:
                dest = param
            else:
                sizes = self._shard_sizes(target.split(".")[-2])
                dest = param.narrow(0, sum(sizes[:shard]), sizes[shard])
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
            loaded.add(f"{target}#{shard}")
        expected = set()
        for name in params:
            module = name.split(".")[-2]
            if module in ("qkv_proj", "gate_up_proj"):
                expected.update(f"{name}#{i}" for i in range(len(self._shard_sizes(module))))
            else:
                expected.add(f"{name}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
