"""The body of `POST /v1/chat/completions` (messages, the chat template's fields, tools and
tool_choice) and of `POST /tokenize`, which renders messages as the chat endpoint does.

A forced tool choice ("required" or a named function) is a structured output over the tools'
parameters; "auto" leaves the calls to the worker's tool call parser.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.engine.structured_output import StructuredOutput
from tandem.limits import FieldLimits
from tandem.server.openai.protocol import SamplingFields, check_constraint_limits

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

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_fields_of_the_request(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for field in ("messages", "tools"):
            if field in (kwargs or {}):
                raise ValueError(
                    f"the template's {field} come from the request's {field} field: send them "
                    "there, not in chat_template_kwargs"
                )
        return kwargs

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
    # vLLM's: the answer opens with the last message's text when that message is the
    # assistant's (the one continue_final_message continues)
    echo: bool = False

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true (as OpenAI and vLLM)")
        return self

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

    def echoed_text(self) -> str:
        """What `echo` opens each choice's content with: the last message's text when it is
        the assistant's, else nothing."""
        if not self.echo or not self.messages or self.messages[-1].role != "assistant":
            return ""
        return self.messages[-1].as_template_input()["content"]

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
