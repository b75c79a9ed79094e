"""DeepSeek-V2 and DeepSeek-V3: decoders of multi-head latent attention
(`tandem.models.layers.mla`) whose MLP is experts from layer first_k_dense_replace on (every
moe_layer_freq-th layer), the first layers keeping a dense MLP.

A sparse layer's MLP is the routed experts of `tandem.models.layers.moe` (V2: softmax top-k,
greedy or group-limited; V3: sigmoid scores with the correction bias, group-limited) plus
shared experts that every token takes (a dense MLP of n_shared_experts * moe_intermediate_size
rows, split over the ranks by rows as the dense MLPs are, expert parallelism or not).

Parameters keep the checkpoint's names: the attention's projections as they are (no packing),
the experts stacked as in `tandem.models.moe`, gate/up of the dense and shared MLPs packed into
gate_up_proj. A checkpoint's multi-token-prediction layers (model.layers.N and on, N the
number of layers; DeepSeek-V3 ships one) are not part of this decoder and are skipped.

The KV cache holds one latent per token and layer (see the MLA module): the layout's one KV
head of (kv_lora_rank + qk_rope_head_dim) / 2 values in each of the two planes, whole on every
rank. On CUDA the norms, MLPs and experts take the fused kernels as the other decoders do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.distributed.group import TensorParallelGroup
from tandem.models.base import KVCacheLayout
from tandem.models.config import ModelConfig, MoEConfig
from tandem.models.layers.attention import ForwardContext
from tandem.models.layers.embedding import VocabParallelEmbedding
from tandem.models.layers.mla import MLARotary, MultiHeadLatentAttention
from tandem.models.layers.moe import SparseMoeBlock
from tandem.models.layers.norm import RMSNorm
from tandem.models.llama import LlamaMLP
from tandem.models.moe import MoeForCausalLM

LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekMoE(SparseMoeBlock):
    """The routed experts plus the shared ones: [T, hidden] -> [T, hidden], summed over the
    ranks."""

    def __init__(
        self, config: ModelConfig, moe: MoEConfig, fused: bool, tp: TensorParallelGroup
    ) -> None:
        super().__init__(config.hidden_size, moe, fused, tp)
        shared_rows = moe.intermediate_size * moe.num_shared_experts
        self.shared_experts = LlamaMLP(replace(config, intermediate_size=shared_rows), fused, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, fused: bool, tp: TensorParallelGroup, mlp: nn.Module
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.self_attn = MultiHeadLatentAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.mlp = mlp


class DeepseekModel(nn.Module):
    def __init__(self, model: DeepseekForCausalLM) -> None:
        super().__init__()
        config, tp = model.config, model.tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, model.fused_ops, tp, model.build_mlp(index))
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, model.fused_ops)
        self.rotary = MLARotary(config)


class DeepseekForCausalLM(MoeForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM. With fused_ops (CUDA): the Triton norms,
    MLPs and experts, and MLA's kernels; decode steps then replay CUDA graphs (no host sync in
    the pass), prompts run eagerly (the piecewise graphs' buffers do not fit latent attention)."""

    piecewise_capturable = False

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fused_ops: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        mla = config.mla
        if (mla.kv_lora_rank + mla.qk_rope_head_dim) % 2:
            raise ValueError(
                f"kv_lora_rank + qk_rope_head_dim is {mla.kv_lora_rank + mla.qk_rope_head_dim}; "
                "tandem's latent KV cache needs an even width"
            )
        super().__init__(config, backend, fused_ops, tp)

    def build_model(self) -> nn.Module:
        return DeepseekModel(self)

    def build_mlp(self, index: int) -> nn.Module:
        moe = self.config.moe
        if moe is None or index not in moe.sparse_layers:
            return LlamaMLP(self.config, self.fused_ops, self.tp)
        return DeepseekMoE(self.config, moe, self.fused_ops, self.tp)

    def forward_context(
        self, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> ForwardContext:
        """MLA ropes its parts itself, fused or not: the angles always."""
        return ForwardContext(positions, slot_mapping, self.model.rotary.cos_sin(positions))

    def kv_cache_layout(self) -> KVCacheLayout:
        mla = self.config.mla
        width = mla.kv_lora_rank + mla.qk_rope_head_dim
        return KVCacheLayout(
            self.config.num_layers, 1, width // 2, latent=(mla.kv_lora_rank, mla.qk_rope_head_dim)
        )

    def attention_inputs(
        self, index: int, hidden: torch.Tensor, kv_cache: torch.Tensor, context: ForwardContext
    ) -> tuple[torch.Tensor, ...]:
        return self.model.layers[index].self_attn.project(hidden, context, kv_cache[index])

    def attention(
        self,
        index: int,
        projected: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, heads * v_head_dim]; `out` is the piecewise CUDA graphs' buffer, and they never
        run this model (they need the fused kernels)."""
        (q,) = projected
        scale = self.model.rotary.softmax_scale
        return self.model.layers[index].self_attn.attend(q, kv_cache[index], metadata, scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As the other decoders, the multi-token-prediction layers' tensors skipped."""

        def in_decoder(name: str) -> bool:
            layer = LAYER_TENSOR.match(name)
            return layer is None or int(layer[1]) < self.config.num_layers

        super().load_weights((name, tensor) for name, tensor in weights if in_decoder(name))

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        if ".self_attn." in name:  # MLA's projections are not packed
            return name, None
        return super().checkpoint_target(name)
