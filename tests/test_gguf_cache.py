"""The GGUF cache against the uncached loader, on a tiny quantized Llama GGUF with a tokenizer:
equal config, tokenizer and model parameters cold and warm, one conversion for any number of loads
(and of racing loaders), damaged entries rebuilt, an unusable cache bypassed, and the same greedy
outputs through `LLM`."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.attention.base import get_backend
from tandem.models import gguf_loader
from tandem.models.config import ModelConfig
from tandem.models.gguf_cache import GGUFCache
from tandem.models.llama import LlamaForCausalLM
from tiny_gguf import write_tiny_llama_gguf

TEXTS = (
    "the cat in a hat",
    " the  the\tthe\n",
    "<|im_start|>user\nin the end<|im_end|>",
    "héllo wörld ✓ 123",
    "",
)
MESSAGES = [{"role": "user", "content": "in the hat"}, {"role": "assistant", "content": "a"}]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def new_model(config: dict, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return LlamaForCausalLM(ModelConfig.from_hf(config), get_backend("torch"), False)
    finally:
        torch.set_default_dtype(previous)


def parameters_of(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """What the uncached loader gives: config, a model's parameters (by dtype), tokenizer."""
    config = gguf_loader.read_gguf_config(tiny_gguf)
    parameters = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = new_model(config, dtype)
        model.load_weights(gguf_loader.iter_gguf_weights(tiny_gguf))
        parameters[dtype] = parameters_of(model)
    return config, parameters, gguf_loader.load_gguf_tokenizer(tiny_gguf)


@pytest.fixture
def conversions(monkeypatch) -> dict[str, int]:
    """How many times each uncached conversion ran (by any thread of this process)."""
    counts = {"config": 0, "weights": 0, "tokenizer": 0}
    for what, name in (
        ("config", "read_gguf_config"),
        ("weights", "iter_gguf_weights"),
        ("tokenizer", "load_gguf_tokenizer"),
    ):
        original = getattr(gguf_loader, name)

        def counted(*args, _what=what, _original=original, **kwargs):
            counts[_what] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(gguf_loader, name, counted)
    return counts


def assert_same_tokenizer(tokenizer, expected) -> None:
    assert tokenizer.backend_tokenizer.to_str() == expected.backend_tokenizer.to_str()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == expected(text)["input_ids"], text
        assert tokenizer.decode(ids) == expected.decode(ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == expected.decode(
            ids, skip_special_tokens=True
        )
    for generation_prompt in (True, False):
        rendered = tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert rendered == expected.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=generation_prompt
        )
    assert tokenizer.all_special_ids == expected.all_special_ids
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        expected.bos_token,
        expected.eos_token,
        expected.pad_token,
    )
    assert len(tokenizer) == len(expected)


def assert_same_parameters(parameters, expected) -> None:
    assert parameters.keys() == expected.keys()
    for name, tensor in parameters.items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


def load_parameters(cache: GGUFCache, path: Path, config: dict, dtype=torch.float32):
    """A fresh model's parameters once the cache has filled them (copies: the damage tests
    change cached files in place, which a mapped parameter would see)."""
    model = new_model(config, dtype)
    cache.load_weights(model, path)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    return parameters_of(model)


def load_all(cache: GGUFCache, path: Path, dtype=torch.float32):
    config = cache.config(path)
    return config, load_parameters(cache, path, config, dtype), cache.tokenizer(path)


def test_second_load_reads_what_the_first_converted(
    tmp_path, tiny_gguf, reference, conversions, caplog
):
    config, parameters, tokenizer = reference
    with caplog.at_level(logging.INFO, logger="tandem.models.gguf_cache"):
        cold = load_all(GGUFCache(tmp_path), tiny_gguf)
    assert conversions == {"config": 1, "weights": 1, "tokenizer": 1}
    for what in ("config", "weights", "tokenizer"):
        converted = rf"{what} converted in \d+\.\d s and cached in "
        assert any(re.match(converted, message) for message in caplog.messages), what
    entry = GGUFCache(tmp_path).entry(tiny_gguf)
    written = {path.name: path.stat().st_mtime_ns for path in entry.iterdir()}
    assert {"config.json", "model.float32.safetensors", "tokenizer"} <= set(written)

    warm = load_all(GGUFCache(tmp_path), tiny_gguf)
    assert conversions == {"config": 1, "weights": 1, "tokenizer": 1}  # nothing converted again
    assert {path.name: path.stat().st_mtime_ns for path in entry.iterdir()} == written
    for loaded in (cold, warm):
        assert loaded[0] == config
        assert_same_parameters(loaded[1], parameters[torch.float32])
        assert_same_tokenizer(loaded[2], tokenizer)


def test_parameters_are_cached_per_dtype(tmp_path, tiny_gguf, reference, conversions):
    config, parameters, _ = reference
    for _ in range(2):
        loaded = load_parameters(GGUFCache(tmp_path), tiny_gguf, config, torch.bfloat16)
        assert_same_parameters(loaded, parameters[torch.bfloat16])
    assert conversions["weights"] == 1
    assert (GGUFCache(tmp_path).entry(tiny_gguf) / "model.bfloat16.safetensors").is_file()


def test_cpu_parameters_map_the_cached_file(tmp_path, tiny_gguf, reference):
    """No copy on the CPU: every parameter is a view of one mapping of the whole file, which
    writes to the parameters never reach."""
    config, parameters, _ = reference
    cache = GGUFCache(tmp_path)
    load_parameters(cache, tiny_gguf, config)  # converts and caches
    cached_file = cache.entry(tiny_gguf) / "model.float32.safetensors"
    before = cached_file.read_bytes()
    model = new_model(config)
    cache.load_weights(model, tiny_gguf)
    storages = {param.untyped_storage().data_ptr() for param in model.parameters()}
    assert len(storages) == 1
    assert model.model.norm.weight.untyped_storage().nbytes() == len(before)
    assert_same_parameters(parameters_of(model), parameters[torch.float32])
    with torch.no_grad():
        model.model.norm.weight.fill_(7.0)
    assert cached_file.read_bytes() == before


def test_a_changed_file_is_a_new_entry(tmp_path, tiny_gguf):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    cache = GGUFCache(tmp_path / "cache")
    before = cache.entry(copy)
    os.utime(copy, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cache.entry(copy) != before
    assert cache.entry(copy).parent == before.parent
    assert cache.entry(tiny_gguf) not in (before, cache.entry(copy))


def test_damaged_artifacts_are_rebuilt(tmp_path, tiny_gguf, reference, conversions, caplog):
    config, parameters, tokenizer = reference
    load_all(GGUFCache(tmp_path), tiny_gguf)
    entry = GGUFCache(tmp_path).entry(tiny_gguf)
    (entry / "config.json").write_text('{"model_type": "llama", "hidden')
    weights_file = entry / "model.float32.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
    (entry / "tokenizer" / "tokenizer.json").write_text("not json")

    with caplog.at_level(logging.WARNING, logger="tandem.models.gguf_cache"):
        rebuilt = load_all(GGUFCache(tmp_path), tiny_gguf)
    assert conversions == {"config": 2, "weights": 2, "tokenizer": 2}
    damaged = [record.getMessage() for record in caplog.records]
    assert len(damaged) == 3 and all("does not load" in message for message in damaged)
    assert rebuilt[0] == config
    assert_same_parameters(rebuilt[1], parameters[torch.float32])
    assert_same_tokenizer(rebuilt[2], tokenizer)

    again = load_all(GGUFCache(tmp_path), tiny_gguf)  # the rebuilt files are whole
    assert conversions == {"config": 2, "weights": 2, "tokenizer": 2}
    assert_same_parameters(again[1], parameters[torch.float32])
    assert [path.name for path in entry.iterdir() if path.name.startswith(".")] == []


def test_a_file_of_other_tensors_is_rebuilt(tmp_path, tiny_gguf, reference, conversions):
    """A whole safetensors file that does not hold the model's parameters (another layout)."""
    from safetensors.torch import save_file

    config, parameters, _ = reference
    entry = GGUFCache(tmp_path).entry(tiny_gguf)
    entry.mkdir(parents=True)
    other = dict(parameters[torch.float32])
    other["extra"] = torch.zeros(3)
    save_file(other, entry / "model.float32.safetensors")
    loaded = load_parameters(GGUFCache(tmp_path), tiny_gguf, config)
    assert conversions["weights"] == 1
    assert_same_parameters(loaded, parameters[torch.float32])


def test_racing_loaders_convert_once(tmp_path, tiny_gguf, reference, monkeypatch):
    """Loaders that start together: one converts, the others wait on the lock and read its
    file (a slow conversion keeps the race window open)."""
    config, parameters, _ = reference
    original = gguf_loader.iter_gguf_weights
    conversions = []

    def slow_weights(path):
        conversions.append(path)
        time.sleep(0.5)
        yield from original(path)

    monkeypatch.setattr(gguf_loader, "iter_gguf_weights", slow_weights)
    results: list[dict] = []
    start = threading.Barrier(3)

    def load() -> None:
        start.wait()
        results.append(load_parameters(GGUFCache(tmp_path), tiny_gguf, config))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 3 and len(conversions) == 1
    for loaded in results:
        assert_same_parameters(loaded, parameters[torch.float32])


def test_an_unusable_cache_is_bypassed(tmp_path, tiny_gguf, reference, conversions, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with caplog.at_level(logging.WARNING, logger="tandem.models.gguf_cache"):
        loaded = load_all(GGUFCache(not_a_folder), tiny_gguf)
    assert loaded[0] == reference[0]
    assert_same_parameters(loaded[1], reference[1][torch.float32])
    assert_same_tokenizer(loaded[2], reference[2])
    assert conversions == {"config": 1, "weights": 1, "tokenizer": 1}
    assert len(caplog.records) == 3
    assert all("cannot be used" in record.getMessage() for record in caplog.records)


def test_the_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "here"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert GGUFCache().root == tmp_path / "here"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert GGUFCache().root == tmp_path / "xdg" / "tandem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert GGUFCache().root == tmp_path / "home" / ".cache" / "tandem"


def test_greedy_outputs_match_the_uncached_path(tmp_path, tiny_gguf, monkeypatch):
    """`LLM` on the GGUF: cold cache, warm cache, and no usable cache (the uncached path) give
    the same parameters, prompt ids, tokens and logprobs."""
    from tandem import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    runs = []
    unusable = tmp_path / "not-a-folder"
    unusable.write_text("")
    for cache_dir in (tmp_path / "cache", tmp_path / "cache", unusable):
        monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache_dir))
        llm = LLM(model=str(tiny_gguf), num_kv_blocks=16, block_size=16)
        [output] = llm.generate("the cat in a hat", params)
        state = {
            name: tensor.clone() for name, tensor in llm.core.executor.model.state_dict().items()
        }
        runs.append((output.prompt_token_ids, output.outputs[0], state))
    (ids, first, state), *others = runs
    assert len(first.token_ids) == 12
    for other_ids, other, other_state in others:
        assert other_ids == ids
        assert other.token_ids == first.token_ids and other.text == first.text
        assert other.logprobs == first.logprobs
        assert other_state.keys() == state.keys()
        assert all(torch.equal(other_state[name], state[name]) for name in state)
