"""The model's shape, read once from a Hugging Face config dict and frozen.

A mixture-of-experts model (Qwen3-MoE, Mixtral) also has a `MoEConfig`: how many experts, how
many each token takes, their MLP size, how the top-k weights are normalised, and which layers
are sparse (the others keep the dense MLP of `intermediate_size`). DeepSeek-V2/V3 add the
routing variants of `tandem.models.layers.moe`, shared experts, and an `MLAConfig` (latent
attention, whose cache holds one latent "KV head": num_kv_heads is 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3",
)  # fmt: skip
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's MLP size
    # the top-k routing weights divided by their sum (Qwen3-MoE's norm_topk_prob; Mixtral always:
    # a softmax over the top-k logits); else the full softmax's probabilities as they are
    renormalize: bool
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts
    # DeepSeek: "softmax" | "sigmoid" scores; topk_method "greedy" | "group_limited_greedy" |
    # "noaux_tc" over num_groups groups of experts (see TopKRouter)
    scoring: str = "softmax"
    topk_method: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # experts every token takes, apart from the routed top-k

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig | None:
        model_type = hf.get("model_type")
        num_layers = hf["num_hidden_layers"]
        if model_type in DEEPSEEK_MODEL_TYPES and hf.get("n_routed_experts"):
            v3 = model_type == "deepseek_v3"
            first_sparse, step = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
            return cls(
                num_experts=hf["n_routed_experts"],
                top_k=hf["num_experts_per_tok"],
                intermediate_size=hf["moe_intermediate_size"],
                renormalize=bool(hf.get("norm_topk_prob", False)),
                sparse_layers=tuple(i for i in range(first_sparse, num_layers) if i % step == 0),
                scoring=hf.get("scoring_func", "sigmoid" if v3 else "softmax"),
                topk_method=hf.get("topk_method", "noaux_tc" if v3 else "greedy"),
                num_groups=hf.get("n_group") or 1,
                topk_groups=hf.get("topk_group") or 1,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                num_shared_experts=hf.get("n_shared_experts") or 0,
            )
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
class MLAConfig:
    """DeepSeek's multi-head latent attention (see tandem.models.layers.mla)."""

    q_lora_rank: int | None  # the compressed query's width (None: q projected directly)
    kv_lora_rank: int  # the latent's width
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary on interleaved pairs (DeepSeek's layout), else on halves

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MLAConfig | None:
        if hf.get("model_type") not in DEEPSEEK_MODEL_TYPES:
            return None
        return cls(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=hf["model_type"] == "deepseek_v2" or hf.get("rope_interleave", True),
        )


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
    mla: MLAConfig | None = None  # DeepSeek's latent attention

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
        mla = MLAConfig.from_hf(hf)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=1 if mla else hf.get("num_key_value_heads") or num_heads,
            head_dim=(
                mla.qk_nope_head_dim + mla.qk_rope_head_dim
                if mla
                else hf.get("head_dim") or hf["hidden_size"] // num_heads
            ),
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
            mla=mla,
        )
