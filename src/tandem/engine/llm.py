"""The offline API: `LLM(model=...).generate(prompts, params)` and `LLM.chat(messages, params)`.

It runs the engine core in this process and steps it until every request it added finishes.
A call that raises (a structured output no text matches, as its request is added; Ctrl-C) takes
its requests out of the engine first: the next call finds none of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem import DEFAULT_MODEL
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.outputs import TokenLogprobs
from tandem.engine.processor import InputProcessor, OutputProcessor, SequenceDelta
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import tokenizer_json
from tandem.models.source import load_tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # one entry per prompt token (None for the first) when SamplingParams.prompt_logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None


Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_settings: Any) -> None:
        self.core = EngineCore(EngineConfig(model=model, **engine_settings))
        config = self.core.config
        self.tokenizer = load_tokenizer(
            self.core.source, config.tokenizer, config.trust_remote_code
        )
        self.inputs = InputProcessor(
            self.tokenizer,
            self.core.max_model_len,
            self.core.model_config.vocab_size,
            self.core.eos_token_ids,
        )
        if (as_json := tokenizer_json(self.tokenizer)) is not None:
            self.core.set_tokenizer(as_json, self.inputs.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params_list = _broadcast(sampling_params, len(prompts))
        return self._run(
            [(p if isinstance(p, str) else None, self.inputs.tokenize(p)) for p in prompts],
            params_list,
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [self.inputs.render_chat(c, **template_kwargs) for c in conversations]
        prompts = [(text, self.inputs.tokenize_rendered_chat(text)) for text in rendered]
        return self._run(prompts, _broadcast(sampling_params, len(prompts)))

    def _run(
        self, prompts: list[tuple[str | None, list[int]]], params_list: list[SamplingParams]
    ) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        batch = []  # every prompt is validated before any request starts
        for (text, token_ids), params in zip(prompts, params_list, strict=True):
            request_id = str(next(self._ids))
            batch.append((request_id, self.inputs.make_requests(request_id, token_ids, params)))
            results[request_id] = RequestOutput(
                request_id, text, token_ids, [CompletionOutput(i) for i in range(params.n)]
            )
        child_ids = [request.request_id for _, requests in batch for request in requests]
        try:
            for request_id, requests in batch:
                for index, request in enumerate(requests):
                    self.outputs.add(request_id, request, index)
                    self.core.add_request(request)  # raises for a constraint nothing matches
            while self.core.has_work():
                deltas, stopped = self.outputs.process(self.core.step())
                self.core.abort_requests(stopped)
                for delta in deltas:
                    self._take(results[delta.request_id], delta)
        except BaseException:  # nothing of this call is left to a later one (Ctrl-C included)
            self.core.abort_requests(child_ids)
            for child_id in child_ids:
                self.outputs.discard(child_id)
            raise
        return [results[request_id] for request_id, _ in batch]

    @staticmethod
    def _take(result: RequestOutput, delta: SequenceDelta) -> None:
        result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
        output = result.outputs[delta.index]
        output.text += delta.text
        output.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            output.logprobs = (output.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            result.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            output.finish_reason = delta.finish_reason
            output.stop_reason = delta.stop_reason


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)
