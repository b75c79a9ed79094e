"""The OpenAI wire format both endpoints share: the sampling fields (OpenAI's and vLLM's), the
structured-output fields, the small bodies of /detokenize and /v1/kv/release, and the error
object every refusal answers with.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; wrong types and
out-of-range values are rejected with a sentence naming the field (the app turns them into 400s).
A `ClientError` is a refusal the client can act on: its status is a 4xx (a 503 when the engine
cannot take the request now), its sentence says what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutput, check_constraint_size
from tandem.limits import FieldLimits


class ClientError(Exception):
    """A request the worker refuses, answered with `error_body`."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


class FieldError(ValueError):
    """A value the worker refuses, with the field (`param`) to change."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, each chunk's usage so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError('response_format of type "json_schema" needs json_schema.schema')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one constraint on the output."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


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
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False  # choices (and stream chunks) carry their token ids
    cache_salt: str | None = None  # vLLM's: the prefix cache's namespace for this request
    priority: int = 0  # vLLM's: lower is scheduled first (a worker with the priority policy)
    prompt_logprobs: int | None = Field(default=None, ge=0)  # vLLM's; at most --max-logprobs
    truncate_prompt_tokens: int | None = None  # vLLM's; refused rather than ignored
    # Structured outputs, asked for in one of three ways: OpenAI's response_format, vLLM's
    # structured_outputs, or vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError(
                "stream_options apply to streamed answers only: set stream to true, or send "
                "no stream_options"
            )
        return self

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _no_truncation(cls, count: int | None) -> int | None:
        if count is not None:
            raise ValueError(
                "truncate_prompt_tokens is not supported; send the prompt's last tokens yourself"
            )
        return count

    def wanted_prompt_logprobs(self) -> int | None:
        """How many top logprobs each prompt token needs (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def engine_max_tokens(self) -> int | None:
        """The most tokens the engine generates (None: up to the context length)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def check_limits(self, limits: FieldLimits) -> None:
        """FieldError saying what to change when a field is over the worker's limits; cheap,
        and before anything costly (a grammar's compilation) is done with the request."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > limits.max_stop_strings:
            raise FieldError(
                f"stop has {len(stop)} strings; this worker takes at most "
                f"{limits.max_stop_strings} (--max-stop-strings): send fewer",
                "stop",
            )
        if len(self.logit_bias or {}) > limits.max_logit_bias:
            raise FieldError(
                f"logit_bias has {len(self.logit_bias)} entries; this worker takes at most "
                f"{limits.max_logit_bias} (--max-logit-bias): send fewer",
                "logit_bias",
            )
        for field_name, constraint in self.asked_constraints().items():
            check_constraint_limits(field_name, constraint, limits)

    def asked_constraints(self) -> dict[str, dict[str, Any]]:
        """The structured-output constraints the request asks for (StructuredOutput's
        arguments), by the field that asks (one of them, if it is to be served)."""
        asked: dict[str, dict[str, Any]] = {}
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.json_schema
            asked["response_format"] = (
                {"json": schema.json_schema} if schema is not None else {"json_object": True}
            )
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(exclude_none=True)
            asked["structured_outputs"] = {
                ("json" if name == "json_schema" else name): value for name, value in given.items()
            }
        guided = {
            kind: value
            for kind, value in (
                ("json", self.guided_json),
                ("regex", self.guided_regex),
                ("choice", self.guided_choice),
                ("grammar", self.guided_grammar),
            )
            if value is not None
        }
        if guided:
            asked["guided_*"] = guided
        return asked

    def wants_structured_output(self) -> bool:
        """Whether the request asks for a structured output (its grammar not compiled)."""
        return bool(self.asked_constraints())

    def structured_output(self) -> StructuredOutput | None:
        """The output constraint the request asks for, checked (ValueError naming the field)."""
        asked = self.asked_constraints()
        if len(asked) > 1:
            raise ValueError(
                f"structured output is asked for twice ({' and '.join(asked)}); use one of them"
            )
        if not asked:
            return None
        ((field_name, constraint),) = asked.items()
        try:
            return StructuredOutput(**constraint)
        except ValueError as exc:
            raise ValueError(f"{field_name}: {exc}") from None

    def sampling_params(self, logprobs: int | None, defaults: Mapping[str, Any]) -> SamplingParams:
        """The engine's settings for this request; `defaults` (request field -> value, from the
        model's generation config) fill the fields it left out, before tandem's own defaults."""

        def chosen(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        max_tokens = self.engine_max_tokens()
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
            structured_output=self.structured_output(),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.wanted_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            cache_salt=self.cache_salt,
            priority=self.priority,
        )


def check_constraint_limits(
    field_name: str, constraint: dict[str, Any], limits: FieldLimits
) -> None:
    try:
        check_constraint_size(
            constraint,
            limits.max_structured_output_bytes,
            limits.max_structured_output_repetition,
        )
    except ValueError as exc:
        param = None if field_name == "guided_*" else field_name
        raise FieldError(f"{field_name}: {exc}", param) from None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class KVReleaseRequest(BaseModel):
    remote_request_id: str


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object; its code is `code`, else the status."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    error = {"message": message, "type": kind, "param": param, "code": code or status}
    return {"error": error}
