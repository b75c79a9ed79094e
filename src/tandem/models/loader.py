"""Build the decoder a model's architecture names and fill its weights.

load_format: "auto" (real weights), or "dummy" (random weights in the config's shape, for
speed runs). Which model a spec names, its tokenizer and its sampling defaults come from
`tandem.models.source`, which an API process reads without torch.

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
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.attention.base import AttentionBackend
from tandem.distributed.group import TensorParallelGroup
from tandem.models import registry
from tandem.models.source import ModelNotFoundError, ModelSource

if TYPE_CHECKING:  # the decoders (and Triton) load only in the engine, not an API process
    from tandem.models.base import CausalLM

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")


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
    from tandem.models.layers import fused_kernels

    return fused_kernels() is not None


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
