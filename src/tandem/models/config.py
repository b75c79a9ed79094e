"""The model's shape, read once from a Hugging Face config dict and frozen.

A mixture-of-experts model (Qwen3-MoE, Mixtral) also has a `MoEConfig`: how many experts, how
many each token takes, their MLP size, how the top-k weights are normalised, and which layers
are sparse (the others keep the dense MLP of `intermediate_size`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's MLP size
    # the top-k routing weights divided by their sum (Qwen3-MoE's norm_topk_prob; Mixtral always:
    # a softmax over the top-k logits); else the full softmax's probabilities as they are
    renormalize: bool
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig | None:
        model_type = hf.get("model_type")
        num_layers = hf["num_hidden_layers"]
        if model_type == "mixtral":
            return cls(
                num_experts=hf["num_local_experts"],
                top_k=hf["num_experts_per_tok"],
                intermediate_size=hf["intermediate_size"],
                renormalize=True,
                sparse_layers=tuple(range(num_layers)),
            )
        if model_type == "qwen3_moe":
            step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
            num_experts = hf.get("num_experts") or hf["num_local_experts"]
            return cls(
                num_experts=num_experts,
                top_k=hf["num_experts_per_tok"],
                intermediate_size=hf["moe_intermediate_size"],
                renormalize=bool(hf.get("norm_topk_prob", False)),
                sparse_layers=tuple(
                    i for i in range(num_layers) if i not in dense and (i + 1) % step == 0
                ),
            )
        return None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # a mixture-of-experts model's experts

    @property
    def has_dense_mlp(self) -> bool:
        """Some layer keeps the dense MLP (every layer of a model without experts)."""
        return self.moe is None or len(self.moe.sparse_layers) < self.num_layers

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported; tandem runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or None)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if kind == "default" else tuple(sorted(rope_scaling.items()))
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=MoEConfig.from_hf(hf),
        )
