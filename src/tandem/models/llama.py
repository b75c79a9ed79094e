"""One Llama-family decoder for Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm),
built from the shared layers of `tandem.models.layers` and following `tandem.models.base`.

Parameters keep Hugging Face names except two packed projections, filled by `load_weights`:

    self_attn.qkv_proj = [q_proj; k_proj; v_proj]     (rows: heads*d, kv_heads*d, kv_heads*d)
    mlp.gate_up_proj   = [gate_proj; up_proj]          (rows: intermediate, intermediate)

Under tensor parallelism (`tp`, see `tandem.distributed.sharding`) each rank holds its query
and KV heads, its MLP rows and its vocabulary rows: the q/k/v and gate/up projections are
column-parallel, o_proj and down_proj row-parallel (one all-reduce each per layer), the embedding
is summed over the ranks and the logits are gathered on rank 0 (None on the others). A prompt's
step on CUDA may run sequence-parallel instead (`TensorParallelGroup.split_sequence`): each rank
keeps its slice of the tokens between the layers, the products gather and scatter the rows, and
the final hidden states are gathered back. Each parameter's weight loader takes this rank's
slice of the checkpoint tensor.

A checkpoint must give every parameter; `load_weights` refuses one that lacks any, or that holds
a tensor of the wrong shape or with no place in the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.distributed.group import TensorParallelGroup
from tandem.models.base import KVCacheLayout
from tandem.models.config import ModelConfig
from tandem.models.layers import fused_kernels
from tandem.models.layers.activation import SiluAndMul
from tandem.models.layers.attention import ForwardContext, PagedAttention
from tandem.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_weight,
)
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    """The projection stage of a layer's attention (q/k/v projection, norms, rotary and, with
    the fused kernels, the K/V store), then `attn` over the paged cache."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fused: bool,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.attention_bias,
            fused=fused,
            tp=tp,
        )
        # this rank's heads
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, fused=fused, tp=tp
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, fused)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, fused)
        self.qk_norm = config.qk_norm
        self.fused = fused
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, config.head_dim, backend, fused
        )

    def project(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        context: ForwardContext,
    ) -> tuple[torch.Tensor, ...]:
        """With the fused kernels (q,), k and v being in the cache already; else (q, k, v)."""
        qkv = self.qkv_proj(hidden)
        num_tokens = qkv.shape[0]  # the step's (hidden: this rank's slice, when split)
        if self.fused:  # q/k norms, rotary and the K/V store in one kernel
            qk_norm = None
            if self.qk_norm:
                qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            q = fused_kernels().qk_norm_rotary_store(
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


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, fused: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], fused=fused, tp=tp
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, fused=fused, tp=tp)
        self.act_fn = SiluAndMul(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm.add_forward(self(x), residual), the down projection's sum fused into the norm
        where it can be (`RowParallelLinear.forward_add_norm`)."""
        activated = self.act_fn(self.gate_up_proj(x))
        return self.down_proj.forward_add_norm(activated, residual, norm)


class LlamaDecoderLayer(nn.Module):
    """mlp: [T, hidden] -> [T, hidden], summed over the ranks (LlamaMLP, or a model's experts)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fused: bool,
        tp: TensorParallelGroup,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.self_attn = LlamaAttention(config, backend, fused, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.mlp = mlp


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fused: bool,
        tp: TensorParallelGroup,
        build_mlp: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, fused, tp, build_mlp(index))
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.rotary = RotaryEmbedding(config)


# HF name fragment -> (packed parameter fragment, shard index)
PACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """fused_ops: use the fused Triton kernels of `triton_ops` (CUDA only); tp: this rank's
    tensor-parallel group (default: one rank)."""

    piecewise_capturable = True

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fused_ops: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.fused_ops = fused_ops
        self.backend = backend
        self.tp = tp or TensorParallelGroup.single()
        self.model = self.build_model()
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, fused_ops, self.tp)
        # a prompt's step may run sequence-parallel (`TensorParallelGroup.split_sequence`) where
        # every layer is this module's attention and dense MLP
        self.splits_sequence = all(
            type(layer.mlp) is LlamaMLP and type(layer.self_attn) is LlamaAttention
            for layer in self.model.layers
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self) -> nn.Module:
        """The decoder stack (a subclass's may have other attention layers)."""
        return LlamaModel(self.config, self.backend, self.fused_ops, self.tp, self.build_mlp)

    def build_mlp(self, index: int) -> nn.Module:
        """Layer `index`'s MLP (a subclass's may be experts)."""
        return LlamaMLP(self.config, self.fused_ops, self.tp)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def kv_cache_layout(self) -> KVCacheLayout:
        kv_heads = self.model.layers[0].self_attn.qkv_proj.kv_heads
        return KVCacheLayout(
            self.config.num_layers, kv_heads.count, self.config.head_dim, kv_heads.start
        )

    def forward_context(
        self, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> ForwardContext:
        cos_sin = None if self.fused_ops else self.model.rotary.cos_sin(positions)
        return ForwardContext(positions, slot_mapping, cos_sin)

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
        attn = self.model.layers[index].self_attn.attn
        return attn.attend(projected, kv_cache[index], metadata, out)

    def layer_output(
        self, index: int, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index` after its attention (output projection, MLP, residual adds): (the next
        layer's normed input, or the final norm's output after the last layer; the residual)."""
        layers = self.model.layers
        layer = layers[index]
        hidden, residual = layer.self_attn.o_proj.forward_add_norm(
            attended, residual, layer.post_attention_layernorm
        )
        is_last = index + 1 == len(layers)
        next_norm = self.model.norm if is_last else layers[index + 1].input_layernorm
        if isinstance(layer.mlp, LlamaMLP):
            return layer.mlp.forward_add_norm(hidden, residual, next_norm)
        return next_norm.add_forward(layer.mlp(hidden), residual)

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
        num_tokens = input_ids.shape[0]
        if not (self.splits_sequence and self.tp.can_split_sequence(num_tokens)):
            hidden, residual = self.embed(input_ids)
            return self.run_layers(hidden, residual, kv_cache, context, metadata, after_layer)
        with self.tp.split_sequence(num_tokens):
            # between the layers this rank holds its slice of the tokens' residual stream
            residual = self.tp.own_rows(self.model.embed_tokens(input_ids))
            hidden = self.model.layers[0].input_layernorm(residual)
            hidden = self.run_layers(hidden, residual, kv_cache, context, metadata, after_layer)
            return self.tp.all_gather_rows(hidden)

    def run_layers(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        kv_cache: torch.Tensor,
        context: ForwardContext,
        metadata: AttentionMetadata,
        after_layer: Callable[[int], None] | None,
    ) -> torch.Tensor:
        """Every layer from layer 0's normed input and the residual stream: the final norm's
        output."""
        for index in range(len(self.model.layers)):
            projected = self.attention_inputs(index, hidden, kv_cache, context)
            attended = self.attention(index, projected, kv_cache, metadata)
            if after_layer is not None:
                after_layer(index)
            hidden, residual = self.layer_output(index, attended, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 on rank 0; None on the other ranks (they take part)."""
        logits = self.lm_head.compute(hidden)
        return None if logits is None else logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in through each parameter's weight loader, packing q/k/v and
        gate/up. Every parameter must be given."""
        params = dict(self.named_parameters())  # a tied weight once
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = self.checkpoint_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            try:
                if hasattr(param, "weight_loader"):
                    param.weight_loader(param, tensor, shard)
                else:
                    copy_weight(param, tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name!r} {exc}") from None
            loaded.add(f"{target}#{shard}")
        expected = set()
        for name, param in params.items():
            expected.update(f"{name}#{shard}" for shard in self.checkpoint_shards(name, param))
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        """(the parameter a checkpoint tensor fills, the shard id its weight loader takes)."""
        for fragment, (packed, index) in PACKED_PROJECTIONS.items():
            if f".{fragment}." in name:
                return name.replace(fragment, packed), index
        return name, None

    def checkpoint_shards(self, name: str, param: nn.Parameter) -> list[Any]:
        """The shard ids of the checkpoint tensors that together fill a parameter."""
        owner = self.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, ColumnParallelLinear) and owner.num_shards > 1:
            return list(range(owner.num_shards))
        return [None]
