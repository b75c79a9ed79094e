"""The front end's two halves, shared by the offline `LLM` and the HTTP server.

InputProcessor: prompt text, token ids or chat messages -> validated engine `Request`s
(one per sample when n > 1, with ids `{request_id}-{index}`).
OutputProcessor: the engine core's token ids -> per-sequence text deltas, finish reasons and
logprobs; it reports which requests a stop string ended so the caller can abort them in the core.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.detokenizer import TextState
from tandem.engine.outputs import EngineCoreOutput, TokenLogprobs
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams


def check_unicode(text: str, field_name: str) -> None:
    """ValueError naming the field when the text holds a lone surrogate (JSON's "\\ud800"
    escapes allow them; UTF-8, and so the tokenizer, does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field_name} holds a lone surrogate (character {exc.start}), which is not valid "
            "Unicode; send valid UTF-8 text"
        ) from None


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


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
            check_unicode(prompt, "prompt")
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty; send at least one token")
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
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def tokenize_rendered_chat(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A rendered chat template's tokens (the template wrote its special tokens itself,
        so none are added unless asked)."""
        check_unicode(text, "messages")
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
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[Request]:
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens but the context length is "
                f"{self.max_model_len}; shorten the prompt"
            )
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
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first delta


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
                )
            )
            if finished:
                self.states.pop(output.request_id, None)
        return deltas, stopped
