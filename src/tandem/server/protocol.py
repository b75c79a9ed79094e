"""OpenAI request bodies (pydantic) and their translation into engine settings.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; wrong types and
out-of-range values are rejected with a sentence naming the field (the app turns them into 400s).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share (OpenAI's and the common vLLM extensions)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> added logit
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False  # choices (and stream chunks) carry their token ids

    def sampling_params(self, logprobs: int | None, defaults: Mapping[str, Any]) -> SamplingParams:
        """The engine's settings for this request; `defaults` (request field -> value, from the
        model's generation config) fill the fields it left out, before tandem's own defaults."""

        def chosen(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=chosen("temperature", 1.0),
            top_p=chosen("top_p", 1.0),
            top_k=chosen("top_k", 0),
            min_p=chosen("min_p", 0.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=chosen("repetition_penalty", 1.0),
            logit_bias=dict(self.logit_bias or {}),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    add_special_tokens: bool = True  # the tokenizer's BOS and the like before a text prompt
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (fill in the middle) is not supported; leave it out")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported; use n and pick among the choices")
        return best_of

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list) and not prompt:
            raise ValueError(
                "prompt is empty; send a string, a list of token ids or a list of those"
            )
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts this request holds (OpenAI allows a list of prompts)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                part.get("text", "") for part in content if part.get("type") == "text"
            )
        return {"role": self.role, "content": content or ""}


class ChatTemplateFields(BaseModel):
    """How messages become a prompt (vLLM's fields): the template's extra arguments, whether it
    opens the assistant's turn or continues the last message, and whether the tokenizer adds
    its special tokens (BOS) on top of the template's."""

    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _one_way_to_end(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message needs add_generation_prompt=false (the assistant's last "
                "message is continued, no new turn is opened)"
            )
        return self

    def template_options(self) -> dict[str, Any]:
        """The chat template's keyword arguments."""
        return {
            **(self.chat_template_kwargs or {}),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages is empty; send at least one message")
        return messages

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(ChatTemplateFields):
    """vLLM's `/tokenize`: the token ids the completions endpoint would compute for `prompt`,
    or the chat endpoint for `messages` (add_special_tokens: default true for a prompt, false
    for messages, as on those endpoints)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class KVReleaseRequest(BaseModel):
    remote_request_id: str


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
