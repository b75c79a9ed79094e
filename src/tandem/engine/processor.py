"""The front end's two halves, shared by the offline `LLM` and the HTTP server.

InputProcessor: prompt text, token ids or chat messages -> validated engine `Request`s
(one per sample when n > 1, with ids `{request_id}-{index}`).
OutputProcessor: the engine core's token ids -> per-sequence text deltas, finish reasons and
logprobs; it reports which requests a stop string ended so the caller can abort them in the core.

A prompt's text is measured before it is tokenized: one token stands for at most so many bytes
of text (`longest_token_bytes`, from the tokenizer's vocabulary and rules), so a text of more
than max_model_len times that cannot fit the context and is refused unread (tokenizing a 50 MB
text takes gigabytes). A token-id prompt is measured before its ids are checked.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem.engine.detokenizer import TextState
from tandem.engine.outputs import EngineCoreOutput, TokenLogprobs
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kv.connector.base import FirstTokenLogprobs, KVTransferParams


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


# Normalizers that keep at least 1/factor of a text's UTF-8 bytes: Unicode normalization and
# case folding map a character to characters of no less than a quarter of its bytes (a 4-byte
# mathematical letter to its ASCII one).
UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
# Pre-tokenizers that split text without dropping any of it (unless told to remove matches).
KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation", "Sequence"}
)


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of input text one token can stand for, or None where the tokenizer's
    rules give no such bound (a normalizer or pre-tokenizer that drops text, unknown text
    fused into one token). Each vocabulary entry's string is at least as long in UTF-8 as the
    text it matches (byte-level BPE writes a byte as one or two bytes, "▁" a space as three,
    "<0x41>" a byte as six); normalization may shrink the text first, by a known factor."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    longest = max((len(token.encode()) for token in tokenizer.get_vocab()), default=1)
    if model.get("type") == "WordPiece":  # an unknown word of up to so many characters
        longest = max(longest, 4 * model.get("max_input_chars_per_word", 100))
    elif model.get("type") != "BPE" or (
        model.get("unk_token") is not None
        and model.get("fuse_unk")
        and not model.get("byte_fallback")
    ):
        return None
    factor = shrink_factor(spec.get("normalizer"))
    if factor is None or not keeps_text(spec.get("pre_tokenizer")):
        return None
    return math.ceil(longest * factor)


def shrink_factor(normalizer: dict[str, Any] | None) -> float | None:
    """By how much a normalizer may shrink a text's UTF-8 bytes at most (None: no bound)."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factors = [shrink_factor(n) for n in normalizer.get("normalizers", [])]
        return None if None in factors else math.prod(factors)
    if kind in UNICODE_NORMALIZERS:
        return 4.0
    if kind == "Prepend":
        return 1.0
    pattern, content = (normalizer.get("pattern") or {}).get("String"), normalizer.get("content")
    if kind == "Replace" and pattern and content:  # a string for another, not a regex
        return max(1.0, len(pattern.encode()) / len(content.encode()))
    return None


def keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer passes every byte of the text on to the model."""
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") not in KEEPING_PRE_TOKENIZERS:
        return False
    if pre_tokenizer.get("behavior") == "Removed":
        return False
    return all(keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))


class InputProcessor:
    def __init__(
        self, tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids | (
            {tokenizer.eos_token_id}
            if tokenizer is not None and tokenizer.eos_token_id is not None
            else set()
        )

    @property
    def has_fast_tokenizer(self) -> bool:
        return getattr(self.tokenizer, "backend_tokenizer", None) is not None

    @functools.cached_property
    def bytes_per_token(self) -> int | None:
        """The most bytes of text one token stands for (None: no bound); worked out on first
        use (a fraction of a second: the tokenizer's whole vocabulary is read)."""
        return longest_token_bytes(self.tokenizer)

    def check_text_fits(self, text: str, field_name: str) -> None:
        """ValueError naming the field when the text holds a lone surrogate (JSON's "\\ud800"
        escapes allow them; UTF-8, and so the tokenizer, does not), or has more bytes than
        max_model_len tokens can stand for (before a tokenizer sees it)."""
        per_token = self.bytes_per_token
        limit = None if per_token is None else self.max_model_len * per_token

        def too_long(size: str) -> ValueError:
            return ValueError(
                f"{field_name}: {size} bytes of text cannot fit in this model's context of "
                f"{self.max_model_len} tokens (max_model_len), as one token stands for at most "
                f"{per_token} bytes of text here; send less text"
            )

        if limit is not None and len(text) > limit:  # characters: no more than its bytes
            raise too_long(f"at least {len(text)}")
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{field_name} holds a lone surrogate (character {exc.start}), which is not "
                "valid Unicode; send valid UTF-8 text"
            ) from None
        if limit is not None and size > limit:
            raise too_long(str(size))

    def check_num_tokens(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_tokens} tokens but the context length is "
                f"{self.max_model_len}; shorten the prompt"
            )

    def _require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as a list of token ids")

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A text prompt's tokens (with the tokenizer's BOS and the like unless told not to), or
        token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; send at least one token")
            self._require_tokenizer()
            self.check_text_fits(prompt, "prompt")
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        if not prompt:
            raise ValueError("the prompt is empty; send at least one token")
        self.check_num_tokens(len(prompt))
        token_ids = list(prompt)
        self.check_token_ids(token_ids, "prompt")
        return token_ids

    def check_token_ids(self, token_ids: Iterable[int], field_name: str) -> None:
        """ValueError naming the field unless every id is in the model's vocabulary."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{field_name}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        self._require_tokenizer()
        if not messages:
            raise ValueError("messages is empty; send at least one message")
        texts = [m.get("content") for m in messages]
        self.check_text_fits("".join(t for t in texts if isinstance(t, str)), "messages")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def tokenize_rendered_chat(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A rendered chat template's tokens (the template wrote its special tokens itself,
        so none are added unless asked)."""
        self.check_text_fits(text, "messages")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        return self.tokenize_rendered_chat(
            self.render_chat(messages, **template_kwargs), add_special_tokens
        )

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> list[Request]:
        num_prompt = len(prompt_token_ids)
        self.check_num_tokens(num_prompt)
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the context length of {self.max_model_len}; lower max_tokens or shorten the "
                "prompt"
            )
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(params.logit_bias, "logit_bias")
        if params.structured_output_after is not None:
            self.check_token_ids([params.structured_output_after], "structured_output_after")
        if params.structured_output is not None and not self.has_fast_tokenizer:
            raise ValueError(
                "structured outputs need the model's tokenizer (a fast one); this model has none"
            )
        if kv_transfer_params is not None and kv_transfer_params.do_remote_decode:
            params = params.first_token_only()  # checked above with the client's max_tokens
        requests = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = params.with_updates(n=1, seed=seed)
            requests.append(
                Request(
                    child_request_id(request_id, index),
                    list(prompt_token_ids),
                    child_params,
                    eos_token_ids=self.eos_token_ids,
                    max_total_tokens=self.max_model_len,
                    kv_transfer_params=kv_transfer_params,
                )
            )
        return requests


@dataclass
class SequenceDelta:
    """What one output sequence gained in one step."""

    request_id: str  # the parent request's id
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None  # a prefill leg's answer (its lease)
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first delta
    # an error's HTTP status: 500 (a bug) unless the server cannot serve now (503: retry) or
    # the request cannot be served (400: its structured output matches nothing)
    error_status: int = 500


@dataclass
class SequenceState:
    request_id: str
    index: int
    text: TextState
    wants_logprobs: bool
    # EOS and stop token ids: a stop on one of them hides its text (none with
    # include_stop_str_in_output)
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, SequenceState] = {}

    def add(self, request_id: str, request: Request, index: int) -> None:
        params = request.sampling_params
        self.states[request.request_id] = SequenceState(
            request_id,
            index,
            TextState(self.tokenizer, request.prompt_token_ids, params),
            params.logprobs is not None,
            frozenset()
            if params.include_stop_str_in_output
            else frozenset(request.eos_token_ids) | frozenset(params.stop_token_ids),
        )

    def discard(self, child_id: str) -> None:
        self.states.pop(child_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[SequenceDelta], list[str]]:
        """Deltas for the outputs, and the child ids a stop string finished (abort them)."""
        deltas, stopped = [], []
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            kv_transfer_params = output.kv_transfer_params
            for position, token_id in enumerate(output.new_token_ids):
                state.token_ids.append(token_id)
                is_last = position == len(output.new_token_ids) - 1
                if is_last and finish_reason == "stop" and token_id in state.stop_ids:
                    continue  # EOS or a stop token id: its text is not part of the output
                stop_string = state.text.add_token(token_id)
                if stop_string is not None:
                    # The core may have finished the request for another reason in this step
                    # (a one-token prefill leg); aborting it then frees what it still holds.
                    finish_reason, stop_reason = "stop", stop_string
                    kv_transfer_params = None  # nothing left for a decode worker to do
                    stopped.append(output.request_id)
                    break
            finished = finish_reason is not None
            if kv_transfer_params is not None and state.wants_logprobs and output.new_logprobs:
                # a prefill leg's lease: the decode leg answers the first token's logprobs too
                kv_transfer_params = with_first_token_logprobs(
                    kv_transfer_params, output.new_logprobs[0]
                )
            deltas.append(
                SequenceDelta(
                    state.request_id,
                    state.index,
                    state.text.take_delta(finished),
                    list(output.new_token_ids),
                    output.new_logprobs if state.wants_logprobs else None,
                    finish_reason,
                    stop_reason,
                    output.num_prompt_tokens,
                    output.num_cached_tokens,
                    kv_transfer_params,
                    output.error,
                    output.prompt_logprobs,
                    output.error_status,
                )
            )
            if finished:
                self.states.pop(output.request_id, None)
        return deltas, stopped


def with_first_token_logprobs(params: KVTransferParams, first: TokenLogprobs) -> KVTransferParams:
    logprobs = FirstTokenLogprobs(first.logprob, [tuple(t) for t in first.top], first.rank)
    return msgspec.structs.replace(params, first_token_logprobs=logprobs)
