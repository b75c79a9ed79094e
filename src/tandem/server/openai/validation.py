"""OpenAI requests checked against this worker and turned into the engine's inputs: the prompt's
token ids (text tokenized, messages rendered by the chat template, both off the event loop) and
the request's `SamplingParams` (a structured output's grammar compiled off the event loop too).

Every refusal is a `ClientError` with a 4xx status and a sentence saying what to change; the
checks a request can fail cheaply come before anything costly is done with it. With a cluster
token, PD fields and KV releases are the cluster's alone (403, `tandem.access`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from tandem.access import from_cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.openai.chat_request import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
)
from tandem.server.openai.protocol import ClientError, SamplingFields
from tandem.server.settings import ServerSettings
from tandem.server.tool_calls import KEEPS_SPECIAL_TOKENS


class RequestInputs:
    """The checks and conversions of one worker's requests (its engine client and settings)."""

    def __init__(self, client: AsyncEngineClient, settings: ServerSettings) -> None:
        self.client = client
        self.settings = settings

    # -- checks ----------------------------------------------------------------------------------

    def require_cluster(
        self, raw: Request, message: str, code: str, param: str | None = None
    ) -> None:
        """With a cluster token, only a request that bears it passes (else a 403)."""
        token = self.settings.cluster_token
        if token is not None and not from_cluster(raw.headers, token):
            raise ClientError(message, 403, param, code)

    def check_model(self, model: str | None) -> None:
        served_names = self.settings.served_names
        if model is not None and model not in served_names:
            raise ClientError(
                f"model {model!r} does not exist; this server serves "
                f"{' or '.join(map(repr, served_names))}",
                404,
                "model",
            )

    def require_tokenizer(self, param: str) -> Any:
        if self.client.tokenizer is None:
            raise ClientError("this model has no tokenizer (a config without weights)", param=param)
        return self.client.tokenizer

    def check_generation(self, body: SamplingFields, raw: Request) -> None:
        """What both generating endpoints check first: the model, the PD fields (the cluster's;
        and what this worker's role and transport allow), priority, and the fields' limits."""
        settings = self.settings
        self.check_model(body.model)
        if body.kv_transfer_params is not None and settings.role != "pd":
            self.require_cluster(
                raw,
                "kv_transfer_params are set by the cluster's router, not by clients: send the "
                "request without them",
                "pd_fields_forbidden",
                "kv_transfer_params",
            )
        if body.priority and settings.scheduling_policy != "priority":
            raise ClientError(
                "priority needs a worker started with --scheduling-policy priority; send "
                "priority 0 (or none)",
                param="priority",
            )
        params = body.kv_transfer_params or {}
        if params.get("do_remote_decode") or params.get("do_remote_prefill"):
            if settings.kv_transport is None:
                raise ClientError(
                    "kv_transfer_params need a worker with a KV transport; start it with "
                    "--role prefill or --role decode",
                    param="kv_transfer_params",
                )
            if body.n > 1 and params.get("do_remote_decode"):
                body.n = 1  # the prompt once, one lease: the decode leg samples the n sequences
            if body.n > 1 and params.get("handoff_id"):
                raise ClientError(
                    "a handoff's decode leg samples one sequence: send n > 1 without a handoff",
                    param="n",
                )
        if params.get("do_remote_prefill") and body.wanted_prompt_logprobs() is not None:
            raise ClientError(
                "prompt logprobs need the prompt computed here; a decode leg loads its KV. "
                "Send the request without kv_transfer_params",
                param="kv_transfer_params",
            )
        if params.get("do_remote_decode") and body.stream:
            raise ClientError(
                "the prefill leg of a PD request cannot stream; send stream=false",
                param="stream",
            )
        try:
            body.check_limits(settings.field_limits)
        except ValueError as exc:  # FieldError names its field
            raise ClientError(str(exc), param=getattr(exc, "param", None)) from exc

    def check_tool_choice(self, body: ChatCompletionRequest) -> None:
        """tool_choice "auto" needs this worker's tool call parser; one whose calls' markers
        are special tokens keeps them in the text."""
        parser = self.settings.tool_call_parser
        if body.auto_tool_choice() and parser is None:
            raise ClientError(
                'tool_choice "auto" (the default when tools are given) needs a worker started '
                "with --enable-auto-tool-choice and --tool-call-parser; send tool_choice "
                '"required", a named function ({"type": "function", "function": {"name": '
                '...}}) or "none"',
                param="tool_choice",
            )
        if body.auto_tool_choice() and parser in KEEPS_SPECIAL_TOKENS:
            body.skip_special_tokens = False

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """A request starts at most as many sequences as the engine's queue holds."""
        max_waiting = self.settings.max_waiting
        if num_prompts * n > max_waiting:
            raise ClientError(
                f"this request starts {num_prompts * n} sequences ({num_prompts} prompts, "
                f"n={n} each), more than this worker's queue holds ({max_waiting}, "
                "--max-waiting): send fewer prompts per request, or a smaller n",
                param="prompt",
            )

    def check_logprobs(self, body: SamplingFields) -> None:
        """At most --max-logprobs per token (-1: the vocabulary), sampled or of the prompt."""
        vocab_size = self.client.info.vocab_size
        max_logprobs = self.settings.max_logprobs
        limit = min(max_logprobs, vocab_size) if max_logprobs >= 0 else vocab_size
        for param in ("logprobs", "top_logprobs", "prompt_logprobs"):
            wanted = getattr(body, param, None)
            if type(wanted) is int and wanted > limit:  # a chat's logprobs is a bool
                raise ClientError(
                    f"{param} asks for {wanted} logprobs per token, more than this worker gives "
                    f"({limit}, --max-logprobs): ask for at most {limit}",
                    param=param,
                )

    # -- conversions -----------------------------------------------------------------------------

    async def sampling_params(
        self, body: SamplingFields, logprobs: int | None, structured_output_after: int | None = None
    ) -> SamplingParams:
        """The request's engine settings, once for all its prompts; a structured output's
        grammar compiles off the event loop (a large one takes a while)."""
        self.check_logprobs(body)
        defaults = self.client.sampling_defaults if self.settings.use_generation_config else {}
        try:
            if body.wants_structured_output():
                params = await asyncio.to_thread(body.sampling_params, logprobs, defaults)
            else:
                params = body.sampling_params(logprobs, defaults)
        except ValueError as exc:
            raise ClientError(str(exc), param=getattr(exc, "param", None)) from exc
        if structured_output_after is not None:
            params = params.with_updates(structured_output_after=structured_output_after)
        return params

    async def tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """A prompt's token ids; text is tokenized off the event loop (a long text takes a
        while, and other requests go on meanwhile)."""
        inputs = self.client.inputs
        try:
            if isinstance(prompt, str):
                return await asyncio.to_thread(inputs.tokenize, prompt, add_special_tokens)
            return inputs.tokenize(prompt, add_special_tokens)
        except ValueError as exc:
            raise ClientError(str(exc), param="prompt") from exc

    def template_options(self, body: ChatTemplateFields) -> dict[str, Any]:
        """The chat template's arguments, the template included: the request's own (a trusting
        worker's only), else --chat-template's, else the model's."""
        options = body.template_options()
        requested = body.requested_chat_template()
        if requested is not None and not self.settings.trust_request_chat_template:
            raise ClientError(
                "this worker takes no chat template from requests: drop chat_template, or start "
                "the worker with --trust-request-chat-template",
                param="chat_template",
            )
        template = requested or self.settings.chat_template
        tokenizer = self.client.tokenizer
        if template is not None:
            options["chat_template"] = template
        elif tokenizer is not None and tokenizer.chat_template is None:
            raise ClientError(
                "this model has no chat template: send the prompt to /v1/completions, or start "
                "the worker with --chat-template",
                param="messages",
            )
        return options

    async def tokenize_messages(
        self, messages: list[ChatMessage], body: ChatTemplateFields, add_special_tokens: bool
    ) -> list[int]:
        """The chat's token ids, its template rendered and tokenized off the event loop."""
        options = self.template_options(body)
        try:
            return await asyncio.to_thread(
                self.client.inputs.tokenize_chat,
                [m.as_template_input() for m in messages],
                add_special_tokens,
                **options,
            )
        except ValueError as exc:
            raise ClientError(str(exc), param="messages") from exc
        except Exception as exc:  # a template error is the request's fault
            raise ClientError(f"the chat template failed on these messages: {exc}") from exc
