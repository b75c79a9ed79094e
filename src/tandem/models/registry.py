"""Model classes by architecture name, as a Hugging Face config's `architectures` names them.

    architecture_of(hf_config) -> "Qwen3ForCausalLM"     the first listed that tandem implements
    model_class("Qwen3ForCausalLM") -> the class         its module imported only now

A config without `architectures` (tandem's shipped configs) is named by its model_type. An
architecture tandem does not implement is a ValueError naming the ones it does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the decoders (and Triton) load only in the engine, not an API process
    from tandem.models.base import CausalLM

# architecture -> (module, class): every Llama-family decoder is one class (see models/llama.py)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tandem.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tandem.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tandem.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("tandem.models.llama", "LlamaForCausalLM"),
    # mixture-of-experts decoders: one class too (see models/moe.py)
    "Qwen3MoeForCausalLM": ("tandem.models.moe", "MoeForCausalLM"),
    "MixtralForCausalLM": ("tandem.models.moe", "MoeForCausalLM"),
    # latent attention and experts (see models/deepseek.py)
    "DeepseekV2ForCausalLM": ("tandem.models.deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("tandem.models.deepseek", "DeepseekForCausalLM"),
}
# model_type -> architecture, for configs that name no architecture
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def unsupported(names: list[str]) -> ValueError:
    return ValueError(
        f"architecture {', '.join(names)} is not supported; tandem runs {', '.join(MODELS)}"
    )


def architecture_of(hf_config: dict[str, Any]) -> str:
    listed = hf_config.get("architectures") or []
    if not listed:
        model_type = hf_config.get("model_type", "llama")
        listed = [ARCHITECTURE_OF_MODEL_TYPE.get(model_type, f"a {model_type!r} model")]
    for architecture in listed:
        if architecture in MODELS:
            return architecture
    raise unsupported(listed)


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODELS:
        raise unsupported([architecture])
    module, name = MODELS[architecture]
    return getattr(importlib.import_module(module), name)
