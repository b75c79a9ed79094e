"""Benchmark prompts: the `random`, `sharegpt` and `prefix` datasets of `tandem bench serve`.

Every sampler returns `num_prompts` `SampleRequest`s, deterministically for a given seed.
Invariants:
* Without a tokenizer, completions prompts are lists of token ids drawn from
  `[vocab_min, vocab_max)`, so `prompt_len` is exact and no tokenizer is needed; chat prompts
  (which must be text) are random common words, one word standing for about one token.
* With a tokenizer (anything with `encode(text, add_special_tokens=...)` and `decode(ids)`),
  prompts are text whose re-encoding has `prompt_len` tokens.
* `prompt_len` is the client's own count; the benchmark reports the server's `usage` instead.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

DATASET_NAMES = ("random", "sharegpt", "prefix")

# ShareGPT filters, as in vLLM's sampler: drop very short and very long conversations.
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048
CHARS_PER_TOKEN_ESTIMATE = 4

COMMON_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river light stone garden window paper music market field table road tree"
).split()


class Tokenizer(Protocol):
    """The two methods of a Hugging Face tokenizer that the datasets use."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send: text or token ids, its client-side token count, its output length."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


@dataclass(frozen=True)
class DatasetOptions:
    """The dataset flags of `tandem bench serve`, resolved once."""

    dataset_name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    chat: bool = False
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    random_vocab_min: int = 1000
    random_vocab_max: int = 20000
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128


class TokenSource:
    """Turns random token ids into prompts of the shape the endpoint needs.

    Completions without a tokenizer take the ids as they are; with a tokenizer, and always for chat,
    prompts are text.
    """

    def __init__(self, options: DatasetOptions, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.chat = options.chat
        self.vocab_min = options.random_vocab_min
        self.vocab_max = options.random_vocab_max
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if vocab_size is not None:
            self.vocab_max = min(self.vocab_max, int(vocab_size))
        if not 0 <= self.vocab_min < self.vocab_max:
            raise ValueError(
                f"random token ids are drawn from [{self.vocab_min}, {self.vocab_max}) "
                "(--random-vocab-min, --random-vocab-max, capped at the tokenizer's vocabulary "
                "size), which must be a non-empty range of non-negative ids"
            )

    def random_ids(self, rng: np.random.Generator, length: int) -> list[int]:
        return rng.integers(self.vocab_min, self.vocab_max, size=length).tolist()

    def to_prompt(self, ids: list[int]) -> tuple[str | list[int], int]:
        """The prompt for `ids` and its token count."""
        if self.tokenizer is not None:
            return text_of_length(self.tokenizer, ids, len(ids))
        if self.chat:
            words = [COMMON_WORDS[token_id % len(COMMON_WORDS)] for token_id in ids]
            return " ".join(words), len(ids)
        return list(ids), len(ids)

    def join(self, prefix: str | list[int], suffix: str | list[int]) -> str | list[int]:
        """Prefix then suffix: ids or decoded text as they are, random words with a space."""
        if isinstance(prefix, list) and isinstance(suffix, list):
            return prefix + suffix
        if self.tokenizer is None and prefix and suffix:
            return f"{prefix} {suffix}"
        return f"{prefix}{suffix}"


def text_of_length(tokenizer: Tokenizer, ids: list[int], length: int) -> tuple[str, int]:
    """Decode `ids`, re-encode, cut to `length` tokens, decode again: text of ~`length` tokens."""
    text = tokenizer.decode(ids)
    re_encoded = tokenizer.encode(text, add_special_tokens=False)[:length]
    return tokenizer.decode(re_encoded), len(re_encoded)


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths uniform around `mean` (vLLM's `--random-range-ratio`)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean * (1.0 + range_ratio)))
    return low, high


def sample_random(options: DatasetOptions, source: TokenSource) -> list[SampleRequest]:
    rng = np.random.default_rng(options.seed)
    input_low, input_high = length_range(options.random_input_len, options.random_range_ratio)
    output_low, output_high = length_range(options.random_output_len, options.random_range_ratio)
    input_lens = rng.integers(input_low, input_high + 1, size=options.num_prompts)
    output_lens = rng.integers(output_low, output_high + 1, size=options.num_prompts)
    prefix_ids = source.random_ids(rng, options.random_prefix_len)
    samples = []
    for input_len, output_len in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        prompt, prompt_len = source.to_prompt(prefix_ids + source.random_ids(rng, input_len))
        samples.append(SampleRequest(prompt, prompt_len, output_len))
    return samples


def sample_prefix(options: DatasetOptions, source: TokenSource) -> list[SampleRequest]:
    """Groups of requests that share a long prefix, each with its own suffix, in shuffled order."""
    num_prefixes = options.prefix_repetition_num_prefixes
    if num_prefixes < 1 or options.num_prompts < num_prefixes:
        raise ValueError(
            f"--prefix-repetition-num-prefixes must be between 1 and --num-prompts "
            f"({options.num_prompts}), got {num_prefixes}"
        )
    rng = np.random.default_rng(options.seed)
    samples = []
    for group in range(num_prefixes):
        prefix, prefix_len = source.to_prompt(
            source.random_ids(rng, options.prefix_repetition_prefix_len)
        )
        group_size = options.num_prompts // num_prefixes
        group_size += int(group < options.num_prompts % num_prefixes)
        for _ in range(group_size):
            suffix, suffix_len = source.to_prompt(
                source.random_ids(rng, options.prefix_repetition_suffix_len)
            )
            samples.append(
                SampleRequest(
                    source.join(prefix, suffix),
                    prefix_len + suffix_len,
                    options.prefix_repetition_output_len,
                )
            )
    random.Random(options.seed).shuffle(samples)
    return samples


def sample_sharegpt(options: DatasetOptions, tokenizer: Tokenizer | None) -> list[SampleRequest]:
    """First human turn as the prompt, the answer's length (or `--sharegpt-output-len`) as the
    output length, skipping conversations that are too short or too long.

    Without a tokenizer, token counts are estimated as characters / 4.
    """
    if options.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    conversations: list[dict[str, Any]] = json.loads(Path(options.dataset_path).read_text())
    random.Random(options.seed).shuffle(conversations)

    def count_tokens(text: str) -> int:
        if tokenizer is None:
            return max(1, round(len(text) / CHARS_PER_TOKEN_ESTIMATE))
        return len(tokenizer.encode(text, add_special_tokens=False))

    samples: list[SampleRequest] = []
    for conversation in conversations:
        turns = conversation.get("conversations") or conversation.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        prompt_len = count_tokens(prompt)
        output_len = options.sharegpt_output_len or count_tokens(answer)
        too_short = prompt_len < SHAREGPT_MIN_TOKENS or (
            options.sharegpt_output_len is None and output_len < SHAREGPT_MIN_TOKENS
        )
        too_long = (
            prompt_len > SHAREGPT_MAX_PROMPT_TOKENS
            or prompt_len + output_len > SHAREGPT_MAX_TOTAL_TOKENS
        )
        if too_short or too_long:
            continue
        samples.append(SampleRequest(prompt, prompt_len, output_len))
        if len(samples) == options.num_prompts:
            return samples
    raise ValueError(
        f"{options.dataset_path} holds only {len(samples)} usable conversations, fewer than "
        f"--num-prompts {options.num_prompts}; lower --num-prompts"
    )


def sample_requests(options: DatasetOptions, tokenizer: Tokenizer | None) -> list[SampleRequest]:
    """The benchmark's prompts for `options`; raises ValueError on flags that do not fit."""
    if options.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {options.num_prompts}")
    if options.dataset_name == "sharegpt":
        return sample_sharegpt(options, tokenizer)
    source = TokenSource(options, tokenizer)
    if options.dataset_name == "random":
        return sample_random(options, source)
    if options.dataset_name == "prefix":
        return sample_prefix(options, source)
    raise ValueError(f"unknown dataset {options.dataset_name!r}; choose one of {DATASET_NAMES}")
