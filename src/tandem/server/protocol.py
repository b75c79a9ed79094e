"""OpenAI request bodies (pydantic) and their translation into engine settings.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; wrong types and
out-of-range values are rejected with a sentence naming the field (the app turns them into 400s).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutput, check_constraint_size
from tandem.limits import FieldLimits


class FieldError(ValueError):
    """A value the worker refuses, with the field (`param`) to change."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


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
    # Structured outputs, asked for in one of three ways: OpenAI's response_format, vLLM's
    # structured_outputs, or vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's and vLLM's default here (chat: up to the context)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs
    add_special_tokens: bool = True  # the tokenizer's BOS and the like before a text prompt
    suffix: str | None = None
    best_of: int | None = None

    def wanted_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too (OpenAI's legacy completions)."""
        counts = [self.prompt_logprobs, self.logprobs if self.echo else None]
        counts = [count for count in counts if count is not None]
        return max(counts) if counts else None

    def scores_prompt_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (with its logprobs), no token
        generated (OpenAI's legacy completions; lm-evaluation-harness's loglikelihood)."""
        return self.echo and self.max_tokens == 0

    def engine_max_tokens(self) -> int | None:
        """As vLLM, a prompt scored only runs for one token, which the answer leaves out."""
        return 1 if self.scores_prompt_only() else super().engine_max_tokens()

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


TOOL_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            others = sorted({str(part.get("type")) for part in content} - {"text"})
            if others:
                raise ValueError(
                    f"content parts of type {', '.join(others)} cannot be read: the model "
                    "takes text only; send text parts"
                )
        return content

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                part.get("text", "") for part in content if part.get("type") == "text"
            )
        message = {"role": self.role, "content": content or ""}
        extra = self.model_extra or {}
        # what a template may show of a tool-using conversation the client carried on itself
        message.update({key: extra[key] for key in TOOL_MESSAGE_FIELDS if key in extra})
        return message


class ChatTemplateFields(BaseModel):
    """How messages become a prompt (vLLM's fields): the request's own template (a worker
    takes it only when trusted), the template's extra arguments, whether it opens the
    assistant's turn or continues the last message, and whether the tokenizer adds its special
    tokens (BOS) on top of the template's."""

    chat_template: str | None = None
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

    def requested_chat_template(self) -> str | None:
        """The template the request brings: its field, or one among the template's arguments."""
        return self.chat_template or (self.chat_template_kwargs or {}).get("chat_template")

    def template_options(self) -> dict[str, Any]:
        """The chat template's keyword arguments (the template itself is the server's choice)."""
        kwargs = dict(self.chat_template_kwargs or {})
        kwargs.pop("chat_template", None)
        return {
            **kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self) -> ChatCompletionRequest:
        """tool_choice "required" or a named function holds the output to the tools' JSON;
        "auto" (the default with tools) lets the model write calls in its own format, which
        the server's tool call parser finds (a server without one refuses it); "none" shows
        the tools to the model (in the chat template) and answers in text, as vLLM."""
        if self.functions is not None or self.function_call is not None:
            raise ValueError(
                "functions and function_call are not supported; use tools and tool_choice"
            )
        names = [tool.function.name for tool in self.tools or []]
        if not names and self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools to choose from")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not among "
                    f"the tools ({', '.join(names)})"
                )
        return self

    def auto_tool_choice(self) -> bool:
        """Whether the model chooses whether to call tools (tool_choice "auto")."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def forced_tool_calls(self) -> str | None:
        """ "required", or the name of the one function to call, or None (no tool calls)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    def wants_structured_output(self) -> bool:
        return super().wants_structured_output() or self.forced_tool_calls() is not None

    def check_limits(self, limits: FieldLimits) -> None:
        """A forced tool call's schema is the tools' parameters: limited as a constraint."""
        super().check_limits(limits)
        if self.forced_tool_calls() is not None:
            schemas = [tool.function.parameters for tool in self.tools or []]
            check_constraint_limits("tools", {"json": schemas}, limits)

    def structured_output(self) -> StructuredOutput | None:
        """A forced tool call holds the output to the arguments' JSON schema (a named
        function) or to a list of {"name", "parameters"} objects, one per call ("required")."""
        other = super().structured_output()
        if (forced := self.forced_tool_calls()) is None:
            return other
        if other is not None:
            raise ValueError("tool calls and structured outputs cannot be asked for together")
        parameters = {
            tool.function.name: tool.function.parameters or {"type": "object"}
            for tool in self.tools or []
        }
        if forced != "required":
            return StructuredOutput(json=parameters[forced])
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in parameters.items()
        ]
        return StructuredOutput(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})

    def template_options(self) -> dict[str, Any]:
        options = super().template_options()
        if self.tools:
            options["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return options

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
