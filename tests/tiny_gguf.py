"""Tiny GGUF files for tests: `write_gguf` (chosen tensors, no tokenizer) and
`write_tiny_llama_gguf` (a whole one-layer Llama with quantized weights and a byte-level BPE
tokenizer of 264 tokens, chat template included), written with the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Byte-level BPE merges (GPT-2's alphabet: "Ġ" is the space byte); each makes one more token.
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_HIDDEN_SIZE = 64
TINY_INTERMEDIATE_SIZE = 96
TINY_NUM_HEADS = 4
TINY_NUM_KV_HEADS = 2


def write_gguf(path, arch, tensors, *, hidden_size=64, num_heads=4, num_kv_heads=2, metadata=()):
    """A minimal Llama-family GGUF file. `tensors` maps GGUF names to (array, raw_dtype or None)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(TINY_INTERMEDIATE_SIZE)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, value in metadata:
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], str):
            writer.add_array(key, value)
        elif isinstance(value, list):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        else:
            writer.add_uint32(key, value)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    stand_ins = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in stand_ins:
            stand_ins[byte] = chr(256 + extra)
            extra += 1
    return [stand_ins[byte] for byte in range(256)]


def tiny_vocabulary() -> list[str]:
    return [*SPECIAL_TOKENS, *byte_level_alphabet(), *(m.replace(" ", "") for m in MERGES)]


def quantize(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, object]:
    if qtype == Q.F32:
        return array.astype(np.float32), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> Path:
    """A one-layer Llama: Q8_0 attention, Q4_1 MLP, F32 norms and embeddings, tied output."""
    rng = np.random.default_rng(seed)
    vocabulary = tiny_vocabulary()
    head_dim = TINY_HIDDEN_SIZE // TINY_NUM_HEADS
    shapes = {  # torch order: (rows, row length)
        "token_embd.weight": ((len(vocabulary), TINY_HIDDEN_SIZE), Q.F32),
        "output_norm.weight": ((TINY_HIDDEN_SIZE,), Q.F32),
        "blk.0.attn_norm.weight": ((TINY_HIDDEN_SIZE,), Q.F32),
        "blk.0.ffn_norm.weight": ((TINY_HIDDEN_SIZE,), Q.F32),
        "blk.0.attn_q.weight": ((TINY_HIDDEN_SIZE, TINY_HIDDEN_SIZE), Q.Q8_0),
        "blk.0.attn_k.weight": ((TINY_NUM_KV_HEADS * head_dim, TINY_HIDDEN_SIZE), Q.Q8_0),
        "blk.0.attn_v.weight": ((TINY_NUM_KV_HEADS * head_dim, TINY_HIDDEN_SIZE), Q.Q8_0),
        "blk.0.attn_output.weight": ((TINY_HIDDEN_SIZE, TINY_HIDDEN_SIZE), Q.Q8_0),
        "blk.0.ffn_gate.weight": ((TINY_INTERMEDIATE_SIZE, TINY_HIDDEN_SIZE), Q.Q4_1),
        "blk.0.ffn_up.weight": ((TINY_INTERMEDIATE_SIZE, TINY_HIDDEN_SIZE), Q.Q4_1),
        "blk.0.ffn_down.weight": ((TINY_HIDDEN_SIZE, TINY_INTERMEDIATE_SIZE), Q.Q4_1),
    }
    tensors = {}
    for name, (shape, qtype) in shapes.items():
        if len(shape) == 1:
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            values = rng.standard_normal(shape) / np.sqrt(shape[1])
        tensors[name] = quantize(values, qtype)
    token_types = [3] * len(SPECIAL_TOKENS) + [1] * (len(vocabulary) - len(SPECIAL_TOKENS))
    metadata = [
        ("llama.rope.dimension_count", head_dim),
        ("llama.vocab_size", len(vocabulary)),
        ("tokenizer.ggml.model", "gpt2"),
        ("tokenizer.ggml.pre", "gpt-2"),
        ("tokenizer.ggml.tokens", vocabulary),
        ("tokenizer.ggml.token_type", token_types),
        ("tokenizer.ggml.merges", list(MERGES)),
        ("tokenizer.ggml.bos_token_id", 1),
        ("tokenizer.ggml.eos_token_id", 2),
        ("tokenizer.ggml.unknown_token_id", 0),
        ("tokenizer.ggml.padding_token_id", 2),
        ("tokenizer.ggml.add_bos_token", True),
        ("tokenizer.chat_template", CHAT_TEMPLATE),
    ]
    write_gguf(
        path,
        "llama",
        tensors,
        hidden_size=TINY_HIDDEN_SIZE,
        num_heads=TINY_NUM_HEADS,
        num_kv_heads=TINY_NUM_KV_HEADS,
        metadata=metadata,
    )
    return path
