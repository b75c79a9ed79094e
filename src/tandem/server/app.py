"""The worker's HTTP server: the OpenAI API over one engine, plus health, metrics and the PD
extensions (kv_transfer_params in and out, `POST /v1/kv/release`). A worker with a cluster token
takes those only from the cluster (`tandem.access`; 403 otherwise); the engine client checks the
fields themselves (`tandem.kv.params`; 400) before the engine sees the request.

Every error a client can cause is an OpenAI-style error object with a 4xx status (an unknown
path or method too); a 5xx means a bug. A client that disconnects aborts its request in the
engine at once. With an API key, every endpoint but /health, /version and /metrics needs it
(`tandem.access`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

import tandem
from tandem.access import from_cluster, guard
from tandem.engine.processor import SequenceDelta
from tandem.engine.sampling_params import SamplingParams
from tandem.http_options import route_error_message
from tandem.limits import BodyLimits, FieldLimits, limit_fastapi_bodies
from tandem.server.engine_client import AsyncEngineClient, EngineDeadError, QueueFullError
from tandem.server.metrics import WorkerMetrics
from tandem.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    KVReleaseRequest,
    SamplingFields,
    TokenizeRequest,
    error_body,
)
from tandem.server.reasoning import split_reasoning, structured_output_start
from tandem.server.tool_calls import (
    KEEPS_SPECIAL_TOKENS,
    calls_so_far,
    content_end,
    parse_tool_calls,
)


class ClientError(Exception):
    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str  # the model's name in answers
    model_aliases: tuple[str, ...] = ()  # more names requests may use
    role: str = "both"
    kv_transport: str | None = None  # tcp | cuda-ipc; None: no KV transfer (a colocated worker)
    kv_host: str | None = None
    # the model's generation config gives the defaults of sampling fields a request leaves out
    use_generation_config: bool = True
    tool_call_parser: str | None = None  # tool_choice "auto" answered with calls in this format
    reasoning_parser: str | None = None  # chat answers' reasoning split off in this format
    chat_template: str | None = None  # used instead of the model's
    trust_request_chat_template: bool = False  # a request may bring its own template
    api_key: str | None = None  # wanted as a bearer token on all but the open endpoints
    # the cluster's secret: with it, only requests bearing it may set PD fields or release KV
    cluster_token: str | None = None
    allowed_origins: tuple[str, ...] = ()  # browser origins answered (CORS)
    scheduling_policy: str = "fcfs"  # the engine's: a request's priority counts under "priority"
    body_limits: BodyLimits = BodyLimits()  # a request body's size and JSON depth
    field_limits: FieldLimits = FieldLimits()  # stop strings, logit_bias, structured outputs
    max_waiting: int = 1024  # the engine's queue: the most sequences one request may start
    max_logprobs: int = 20  # the most logprobs per token a request may ask for (-1: the vocabulary)


@dataclass
class Choice:
    """One output sequence being assembled from deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None  # one entry per prompt token, None for the first
    # streamed chat with tool_choice "auto" or a reasoning parser: characters of the content
    # (the text after the reasoning, if any) and of the reasoning sent
    content_sent: int = 0
    reasoning_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)  # per tool call begun (streamed)


def _error(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def build_app(client: AsyncEngineClient, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="tandem worker", docs_url=None, redoc_url=None)
    limit_fastapi_bodies(app, settings.body_limits)  # inside the API key's check
    guard(
        app,
        settings.api_key,
        allowed_origins=settings.allowed_origins,
        cluster_token=settings.cluster_token,
    )
    metrics = WorkerMetrics(settings.served_model_name)
    client.stats_listener = metrics.update_from_stats
    app.state.client = client
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return _error("the request body is not valid JSON", 400)
        location = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        return _error(f"{location or 'body'}: {message}", 400, location or None)

    @app.exception_handler(ClientError)
    async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
        return _error(str(exc), exc.status, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _route_error(request: Request, exc: HTTPException) -> JSONResponse:
        """An unknown path (404) or a method its path does not take (405)."""
        message, code = route_error_message(
            request.method, request.url.path, exc.status_code, exc.headers, exc.detail
        )
        response = _error(message, exc.status_code, code=code)
        response.headers.update(exc.headers or {})
        return response

    @app.get("/health")
    async def health() -> Response:
        if client.healthy:
            return JSONResponse({"status": "ok", "role": settings.role, "kv": kv_endpoint()})
        return _error("the engine is not running", 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tandem.__version__}

    def kv_endpoint() -> dict[str, Any] | None:
        """What a router needs to hand a decode leg off before the prefill answers: the
        transport, and where a decode worker waits for this (prefill) worker's announcement."""
        if settings.kv_transport is None:
            return None
        endpoint: dict[str, Any] = {"transport": settings.kv_transport, "handoff": True}
        if client.info.kv_port is not None:
            endpoint.update(host=settings.kv_host, port=client.info.kv_port)
        return endpoint

    served_names = (settings.served_model_name, *settings.model_aliases)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tandem",
            "max_model_len": client.info.max_model_len,
        }
        return {"object": "list", "data": [{"id": name, **card} for name in served_names]}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def require_cluster(raw: Request, message: str, code: str, param: str | None = None) -> None:
        """With a cluster token, PD fields and KV releases are the cluster's alone (a 403)."""
        if settings.cluster_token is not None and not from_cluster(
            raw.headers, settings.cluster_token
        ):
            raise ClientError(message, 403, param, code)

    @app.post("/v1/kv/release")
    async def release_kv(body: KVReleaseRequest, raw: Request) -> dict[str, Any]:
        message = "KV leases are released by the cluster's router, not by clients"
        require_cluster(raw, message, "kv_release_forbidden")
        if not await client.release_kv(body.remote_request_id):
            raise ClientError(
                f"no KV lease {body.remote_request_id!r} is held here: it was released, it "
                "expired, or this worker never handed it out",
                404,
                "remote_request_id",
            )
        return {"released": body.remote_request_id}

    def check_model(model: str | None) -> None:
        if model is not None and model not in served_names:
            raise ClientError(
                f"model {model!r} does not exist; this server serves "
                f"{' or '.join(map(repr, served_names))}",
                404,
                "model",
            )

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ClientError("send either prompt or messages")
        if body.messages is not None:
            token_ids = await tokenize_messages(body.messages, body, bool(body.add_special_tokens))
        else:
            token_ids = await tokenize(body.prompt, body.add_special_tokens is not False)
        token_strs = None
        if body.return_token_strs:
            token_strs = require_tokenizer("return_token_strs").convert_ids_to_tokens(token_ids)
        return {
            "count": len(token_ids),
            "max_model_len": client.info.max_model_len,
            "tokens": token_ids,
            "token_strs": token_strs,
        }

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        try:
            client.inputs.check_token_ids(body.tokens, "tokens")
        except ValueError as exc:
            raise ClientError(str(exc), param="tokens") from exc
        return {"prompt": require_tokenizer("tokens").decode(body.tokens)}

    def require_tokenizer(param: str):
        if client.tokenizer is None:
            raise ClientError("this model has no tokenizer (a config without weights)", param=param)
        return client.tokenizer

    def check_common(body: SamplingFields, raw: Request) -> None:
        check_model(body.model)
        if body.kv_transfer_params is not None and settings.role != "pd":
            require_cluster(
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

    def check_field_limits(body: SamplingFields) -> None:
        try:
            body.check_limits(settings.field_limits)
        except ValueError as exc:  # FieldError names its field
            raise ClientError(str(exc), param=getattr(exc, "param", None)) from exc

    def check_logprobs(body: SamplingFields) -> None:
        """At most --max-logprobs per token (-1: the vocabulary), sampled or of the prompt."""
        vocab_size = client.info.vocab_size
        limit = min(settings.max_logprobs, vocab_size) if settings.max_logprobs >= 0 else vocab_size
        for param in ("logprobs", "top_logprobs", "prompt_logprobs"):
            wanted = getattr(body, param, None)
            if type(wanted) is int and wanted > limit:  # a chat's logprobs is a bool
                raise ClientError(
                    f"{param} asks for {wanted} logprobs per token, more than this worker gives "
                    f"({limit}, --max-logprobs): ask for at most {limit}",
                    param=param,
                )

    async def sampling_params(
        body: SamplingFields, logprobs: int | None, structured_output_after: int | None = None
    ) -> SamplingParams:
        """The request's engine settings, once for all its prompts; a structured output's
        grammar compiles off the event loop (a large one takes a while)."""
        check_logprobs(body)
        defaults = client.sampling_defaults if settings.use_generation_config else {}
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

    async def start(
        request_id: str, prompt_ids: list[int], body: SamplingFields, params: SamplingParams
    ) -> PrimedStream:
        """Validate, submit and return the request's delta stream, primed: admission errors
        surface here as ClientErrors, before any response byte is written."""
        try:
            stream = client.generate(request_id, prompt_ids, params, body.kv_transfer_params)
            first = await anext(stream)
        except (QueueFullError, EngineDeadError) as exc:
            raise ClientError(str(exc), 503) from exc
        except ValueError as exc:  # KVParamsError names its field
            raise ClientError(str(exc), param=getattr(exc, "param", None)) from exc
        if first.finish_reason == "error":  # failed before its first token: a 5xx, no stream
            await stream.aclose()
            check_error(first)
        metrics.prompt_tokens.labels(settings.served_model_name).inc(len(prompt_ids))
        return PrimedStream(first, stream)

    async def tokenize(prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """A prompt's token ids; text is tokenized off the event loop (a long text takes a
        while, and other requests go on meanwhile)."""
        try:
            if isinstance(prompt, str):
                return await asyncio.to_thread(client.inputs.tokenize, prompt, add_special_tokens)
            return client.inputs.tokenize(prompt, add_special_tokens)
        except ValueError as exc:
            raise ClientError(str(exc), param="prompt") from exc

    def template_options(body: ChatTemplateFields) -> dict[str, Any]:
        """The chat template's arguments, the template included: the request's own (a trusting
        worker's only), else --chat-template's, else the model's."""
        options = body.template_options()
        requested = body.requested_chat_template()
        if requested is not None and not settings.trust_request_chat_template:
            raise ClientError(
                "this worker takes no chat template from requests: drop chat_template, or start "
                "the worker with --trust-request-chat-template",
                param="chat_template",
            )
        template = requested or settings.chat_template
        if template is not None:
            options["chat_template"] = template
        elif client.tokenizer is not None and client.tokenizer.chat_template is None:
            raise ClientError(
                "this model has no chat template: send the prompt to /v1/completions, or start "
                "the worker with --chat-template",
                param="messages",
            )
        return options

    async def tokenize_messages(
        messages: list[ChatMessage], body: ChatTemplateFields, add_special_tokens: bool
    ) -> list[int]:
        """The chat's token ids, its template rendered and tokenized off the event loop."""
        options = template_options(body)
        try:
            return await asyncio.to_thread(
                client.inputs.tokenize_chat,
                [m.as_template_input() for m in messages],
                add_special_tokens,
                **options,
            )
        except ValueError as exc:
            raise ClientError(str(exc), param="messages") from exc
        except Exception as exc:  # a template error is the request's fault
            raise ClientError(f"the chat template failed on these messages: {exc}") from exc

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_common(body, raw)
        check_field_limits(body)
        prompts = body.prompts()
        if len(prompts) * body.n > settings.max_waiting:
            raise ClientError(
                f"this request starts {len(prompts) * body.n} sequences ({len(prompts)} prompts, "
                f"n={body.n} each), more than this worker's queue holds ({settings.max_waiting}, "
                "--max-waiting): send fewer prompts per request, or a smaller n",
                param="prompt",
            )
        prompt_ids = [await tokenize(p, body.add_special_tokens) for p in prompts]
        if body.kv_transfer_params and len(prompts) != 1:
            raise ClientError("a PD request must hold exactly one prompt", param="prompt")
        base_id = client.new_request_id()
        params = await sampling_params(body, body.logprobs)
        starts = [
            functools.partial(start, f"{base_id}-p{i}", ids, body, params)
            for i, ids in enumerate(prompt_ids)
        ]
        writer = CompletionWriter(client, settings, body, f"cmpl-{base_id}", prompts, prompt_ids)
        return await respond(raw, body, starts, writer)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_common(body, raw)
        check_field_limits(body)
        if body.auto_tool_choice() and settings.tool_call_parser is None:
            raise ClientError(
                'tool_choice "auto" (the default when tools are given) needs a worker started '
                "with --enable-auto-tool-choice and --tool-call-parser; send tool_choice "
                '"required", a named function ({"type": "function", "function": {"name": '
                '...}}) or "none"',
                param="tool_choice",
            )
        if body.auto_tool_choice() and settings.tool_call_parser in KEEPS_SPECIAL_TOKENS:
            body.skip_special_tokens = False  # the calls' markers are special tokens
        prompt_ids = await tokenize_messages(body.messages, body, body.add_special_tokens)
        base_id = client.new_request_id()
        writer = ChatWriter(client, settings, body, f"chatcmpl-{base_id}", [prompt_ids])
        params = await sampling_params(body, body.num_logprobs(), writer.structured_output_after)
        starts = [functools.partial(start, base_id, prompt_ids, body, params)]
        return await respond(raw, body, starts, writer)

    async def respond(raw: Request, body: SamplingFields, starts, writer) -> Response:
        """Streamed: start every prompt before the response head, so admission errors are 4xx.
        The client's disconnect cancels everything, the starts included (a prefill leg's whole
        work happens before its first token, a handoff's decode leg waits for it)."""
        arrival = time.monotonic()
        if body.stream:
            # Starting may take long (a handoff's first token comes when the prefill is done):
            # a client that leaves meanwhile aborts it.
            streams = await until_disconnected(raw, start_all(starts))
            if streams is None:
                return Response(status_code=499)
            return StreamingResponse(
                sse(writer.stream(merge(streams), metrics, arrival)),
                media_type="text/event-stream",
            )

        async def work() -> dict[str, Any]:
            streams = await start_all(starts)
            return await writer.collect(merge(streams), metrics, arrival)

        result = await until_disconnected(raw, work())
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result)

    return app


async def start_all(starts) -> list[PrimedStream]:
    """Start the prompts of a request together; if one is refused, close the others (which
    aborts them) and raise its error."""
    results = await asyncio.gather(*(begin() for begin in starts), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for stream in results:
            if not isinstance(stream, BaseException):
                await stream.aclose()
        raise failures[0]
    return results


class PrimedStream:
    """A request's delta stream whose first delta was already awaited (admission is over)."""

    def __init__(self, first: SequenceDelta, rest: AsyncIterator[SequenceDelta]) -> None:
        self.first = first
        self.rest = rest

    async def __aiter__(self) -> AsyncIterator[SequenceDelta]:
        yield self.first
        async for delta in self.rest:
            yield delta

    async def aclose(self) -> None:
        await self.rest.aclose()  # aborts the request in the engine


async def merge(streams: list[AsyncIterator[SequenceDelta]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave the delta streams of several prompts as (prompt index, delta)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[SequenceDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Run work; if the client disconnects first, cancel it (which aborts the request)."""
    work_task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watch_task = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (server shutdown): never leave work behind
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task in done:
        return work_task.result()
    return None


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


class ResponseWriter:
    """Turns delta streams into one OpenAI response (collected) or its chunks (streamed)."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, client, settings, body, response_id, prompt_ids) -> None:
        self.client = client
        self.settings = settings
        self.body = body
        self.response_id = response_id
        self.prompt_ids = prompt_ids
        self.created = int(time.time())
        self.n = body.n

    def choice_index(self, prompt_index: int, delta: SequenceDelta) -> int:
        return prompt_index * self.n + delta.index

    def usage(self, choices: dict[int, Choice], cached: int) -> dict[str, Any]:
        prompt_tokens = sum(len(ids) for ids in self.prompt_ids)
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def with_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        if self.body.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def token_text(self, token_id: int) -> str:
        tokenizer = self.client.tokenizer
        return "" if tokenizer is None else tokenizer.decode([token_id])

    def with_prompt_logprobs(self, target: dict[str, Any], entries: list | None) -> dict[str, Any]:
        """`target` with vLLM's prompt_logprobs when the request asked for them: per prompt
        token (None for the first) {token id: {logprob, rank, decoded_token}} for the token
        and the top prompt_logprobs."""
        count = self.body.prompt_logprobs
        if count is None or entries is None:
            return target
        listed: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                listed.append(None)
                continue
            item = {
                str(entry.token_id): self.vllm_logprob(entry.token_id, entry.logprob, entry.rank)
            }
            for rank, (token_id, logprob) in enumerate(entry.top[:count], start=1):
                item.setdefault(str(token_id), self.vllm_logprob(token_id, logprob, rank))
            listed.append(item)
        target["prompt_logprobs"] = listed
        return target

    def vllm_logprob(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token_id)}

    def new_choices(self) -> dict[int, Choice]:
        return {index: Choice() for index in range(len(self.prompt_ids) * self.n)}

    async def collect(self, deltas, metrics: WorkerMetrics, arrival: float) -> dict[str, Any]:
        choices = self.new_choices()
        cached = 0
        kv_transfer_params = None
        tracker = LatencyTracker(metrics, self.settings.served_model_name, arrival)
        try:
            async for prompt_index, delta in deltas:
                tracker.observe(delta)
                choice = choices[self.choice_index(prompt_index, delta)]
                choice.text += delta.text
                choice.token_ids.extend(delta.token_ids)
                choice.logprobs.extend(delta.logprobs or [])
                if delta.prompt_logprobs is not None:
                    choice.prompt_logprobs = delta.prompt_logprobs
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    choice.stop_reason = delta.stop_reason
                    cached += delta.num_cached_tokens
                    kv_transfer_params = delta.kv_transfer_params or kv_transfer_params
                check_error(delta)
        finally:  # a request cut short (disconnect, error) is counted too
            tracker.finish(choices.values())
        response = {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.settings.served_model_name,
            "choices": [
                self.with_token_ids(self.full_choice(i, choices[i]), choices[i].token_ids)
                for i in sorted(choices)
            ],
            "usage": self.usage(choices, cached),
        }
        if self.body.kv_transfer_params is not None:
            response["kv_transfer_params"] = kv_transfer_params
        return self.with_response_fields(response, choices)

    def with_response_fields(
        self, response: dict[str, Any], choices: dict[int, Choice]
    ) -> dict[str, Any]:
        """What a response holds besides its choices (by endpoint)."""
        return response

    async def stream(
        self, deltas, metrics: WorkerMetrics, arrival: float
    ) -> AsyncIterator[dict[str, Any]]:
        choices = self.new_choices()
        cached = 0
        tracker = LatencyTracker(metrics, self.settings.served_model_name, arrival)
        try:
            async for event in self.opening_chunks():
                yield event
            async for prompt_index, delta in deltas:
                tracker.observe(delta)
                index = self.choice_index(prompt_index, delta)
                choice = choices[index]
                choice.text += delta.text
                choice.token_ids.extend(delta.token_ids)
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    cached += delta.num_cached_tokens
                if delta.finish_reason == "error":
                    message = delta.error or "the request failed"
                    yield {"error": error_body(message, delta.error_status)["error"]}
                    return
                wants_ids = self.body.return_token_ids and delta.token_ids
                if delta.text or delta.finish_reason is not None or delta.logprobs or wants_ids:
                    choice_chunk = self.delta_choice(index, delta, choice)
                    if choice_chunk is not None:
                        yield self.chunk([self.with_token_ids(choice_chunk, delta.token_ids)])
        finally:  # a request cut short (disconnect, error) is counted too
            tracker.finish(choices.values())
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield self.chunk([], usage=self.usage(choices, cached))

    async def opening_chunks(self) -> AsyncIterator[dict[str, Any]]:
        return
        yield

    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        chunk = {
            "id": self.response_id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.settings.served_model_name,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk


class CompletionWriter(ResponseWriter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, client, settings, body, response_id, prompts, prompt_ids) -> None:
        super().__init__(client, settings, body, response_id, prompt_ids)
        self.prompt_texts = [
            p if isinstance(p, str) else client.tokenizer.decode(p) if client.tokenizer else ""
            for p in prompts
        ]
        # echo with max_tokens 0: the engine's one token stays out of the answer (as in vLLM)
        self.prompt_only = body.scores_prompt_only()

    def usage(self, choices: dict[int, Choice], cached: int) -> dict[str, Any]:
        usage = super().usage(choices, cached)
        if self.prompt_only:
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    def with_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        return super().with_token_ids(choice, [] if self.prompt_only else token_ids)

    def logprobs_object(
        self, logprobs: list, index: int, prompt_logprobs: list | None = None
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs; with echo, the prompt's tokens come first (the first one
        without a logprob, as nothing predicts it)."""
        if self.body.logprobs is None:
            return None
        rows = [] if self.prompt_only else [(i.token_id, i.logprob, i.top) for i in logprobs]
        if self.body.echo and prompt_logprobs is not None:
            prompt_ids = self.prompt_ids[index // self.n]
            rows[:0] = [(prompt_ids[0], None, None)] + [
                (item.token_id, item.logprob, item.top) for item in prompt_logprobs[1:]
            ]
        tokens, values, tops, offsets = [], [], [], []
        offset = 0
        for token_id, logprob, top in rows:
            text = self.token_text(token_id)
            tokens.append(text)
            values.append(logprob)
            top = None if top is None else top[: self.body.logprobs]
            tops.append(None if top is None else {self.token_text(t): lp for t, lp in top})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def full_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        prefix = self.prompt_texts[index // self.n] if self.body.echo else ""
        return self.with_prompt_logprobs(
            {
                "index": index,
                "text": prefix + ("" if self.prompt_only else choice.text),
                "logprobs": self.logprobs_object(choice.logprobs, index, choice.prompt_logprobs),
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            },
            choice.prompt_logprobs,
        )

    async def opening_chunks(self) -> AsyncIterator[dict[str, Any]]:
        if self.body.echo:
            for prompt_index, text in enumerate(self.prompt_texts):
                for sample in range(self.n):
                    index = prompt_index * self.n + sample
                    yield self.chunk(
                        [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]
                    )

    def delta_choice(self, index: int, delta: SequenceDelta, choice: Choice) -> dict[str, Any]:
        """A chunk; the first one after an echoed prompt carries the prompt's logprobs."""
        return self.with_prompt_logprobs(
            {
                "index": index,
                "text": "" if self.prompt_only else delta.text,
                "logprobs": self.logprobs_object(
                    delta.logprobs or [], index, delta.prompt_logprobs
                ),
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            },
            delta.prompt_logprobs,
        )


class ChatWriter(ResponseWriter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def with_response_fields(
        self, response: dict[str, Any], choices: dict[int, Choice]
    ) -> dict[str, Any]:
        """vLLM puts a chat's prompt_logprobs beside its choices (they share the prompt)."""
        return self.with_prompt_logprobs(response, choices[0].prompt_logprobs)

    def logprobs_object(self, logprobs: list) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                dict(entry(item.token_id, item.logprob), top_logprobs=[entry(*t) for t in item.top])
                for item in logprobs
            ]
        }

    def forced_calls(self, text: str) -> list[tuple[str, str]] | None:
        """The (name, arguments) of the calls a forced tool choice's output holds; None when
        it is not complete JSON (cut short by max_tokens)."""
        forced = self.body.forced_tool_calls()
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if forced == "required":
            return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
        return [(forced, text)]

    def auto_tool_call_parser(self) -> str | None:
        """The parser that finds this request's tool calls in its text (tool_choice "auto")."""
        return self.settings.tool_call_parser if self.body.auto_tool_choice() else None

    @functools.cached_property
    def is_structured(self) -> bool:
        """A structured output or a forced tool call holds (part of) the answer (an unusable
        one too: the request's params refuse it, a 400)."""
        return self.body.wants_structured_output()

    @functools.cached_property
    def structured_output_after(self) -> int | None:
        """With a reasoning parser, the token after which a structured output or a forced tool
        call holds the answer (the reasoning's end tag: the reasoning before it is free); None
        when there is none to wait for (see `structured_output_start`)."""
        if self.settings.reasoning_parser is None or self.client.tokenizer is None:
            return None
        if not self.is_structured:
            return None
        return structured_output_start(self.client.tokenizer, self.prompt_ids[0])

    @functools.cached_property
    def reasoning_parser(self) -> str | None:
        """The parser that splits this request's reasoning off its content; none for a
        structured output or a forced tool call held from its first token (no reasoning)."""
        if self.settings.reasoning_parser is None:
            return None
        if self.is_structured and self.structured_output_after is None:
            return None  # held from its first token
        return self.settings.reasoning_parser

    def answer(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """The message's body (reasoning if split off, content, and the tool calls if any)
        and the finish reason, which is "tool_calls" for tool_choice "required" and for calls
        found with "auto" (as in vLLM)."""
        text, body = choice.text, {}
        if self.reasoning_parser is not None:
            split = split_reasoning(self.reasoning_parser, text, finished=True)
            text = split.content(text) or ""
            if split.reasoning is not None:
                body = {"reasoning": split.reasoning, "reasoning_content": split.reasoning}
        content: str | None = (text or None) if body else text  # null beside reasoning
        calls, finish_reason = None, choice.finish_reason
        if (forced := self.body.forced_tool_calls()) is not None:
            calls = self.forced_calls(text)
            if calls is not None:
                content = None
                if forced == "required" and finish_reason == "stop":
                    finish_reason = "tool_calls"
        elif (parser := self.auto_tool_call_parser()) is not None:
            parsed = parse_tool_calls(parser, text)
            if parsed.calls:
                content, calls, finish_reason = parsed.content, parsed.calls, "tool_calls"
        if calls is None:
            return {**body, "content": content}, finish_reason
        tool_calls = [new_tool_call(name, arguments) for name, arguments in calls]
        return {**body, "content": content, "tool_calls": tool_calls}, finish_reason

    def full_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        body, finish_reason = self.answer(choice)
        return {
            "index": index,
            "message": {"role": "assistant", **body},
            "logprobs": self.logprobs_object(choice.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }

    async def opening_chunks(self) -> AsyncIterator[dict[str, Any]]:
        yield self.chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(self.n)
            ]
        )

    def delta_choice(
        self, index: int, delta: SequenceDelta, choice: Choice
    ) -> dict[str, Any] | None:
        """A chunk, or None when it would say nothing. Forced tool calls go out whole in the
        last chunk; with tool_choice "auto", text that may begin a call is held back, a call
        the parser can stream goes out as the model writes it (its index, id and name first,
        then pieces of its arguments), and the other calls found go out whole in the last chunk.
        With a reasoning parser, the reasoning goes out as `reasoning` (and `reasoning_content`,
        its older name), less what may begin its end tag, and the content after it."""
        body, finish_reason = {"content": delta.text} if delta.text else {}, delta.finish_reason
        forced = self.body.forced_tool_calls() is not None
        parser = self.auto_tool_call_parser()
        if forced or parser is not None or self.reasoning_parser is not None:
            if delta.finish_reason is not None:
                body, finish_reason = self.last_delta(choice)
            elif forced and self.reasoning_parser is None:
                return None
            else:  # a forced call's reasoning streams, its calls wait for the end
                body = self.pieces_so_far(choice, parser, content=not forced)
                says_more = delta.logprobs or (self.body.return_token_ids and delta.token_ids)
                if not body and not says_more:
                    return None
        return {
            "index": index,
            "delta": body,
            "logprobs": self.logprobs_object(delta.logprobs or []),
            "finish_reason": finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def pieces_so_far(
        self, choice: Choice, tool_call_parser: str | None, content: bool = True
    ) -> dict[str, Any]:
        """The reasoning, content (unless held) and tool calls of an unfinished output not sent
        yet, less what may begin the reasoning's end tag or a tool call."""
        text, body = choice.text, {}
        if self.reasoning_parser is not None:
            split = split_reasoning(
                self.reasoning_parser, text, finished=False, known=choice.reasoning_sent
            )
            text = split.content(text) or ""
            if piece := (split.reasoning or "")[choice.reasoning_sent :]:
                body = {"reasoning": piece, "reasoning_content": piece}
                choice.reasoning_sent += len(piece)
        if not content:
            return body
        end = len(text)
        if tool_call_parser is not None:
            end = max(choice.content_sent, content_end(tool_call_parser, text))
        if piece := text[choice.content_sent : end]:
            body["content"] = piece
            choice.content_sent = end
        if tool_call_parser is not None:
            begun = calls_so_far(tool_call_parser, text)
            if calls := self.call_pieces(choice, [(c.name, c.arguments) for c in begun]):
                body["tool_calls"] = calls
        return body

    @staticmethod
    def call_pieces(choice: Choice, calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """The tool call deltas that bring what was sent of the calls up to `calls` (name,
        arguments so far): a call not begun yet goes out with its index, id, type and name,
        and every call with the arguments not sent yet."""
        pieces, sent = [], choice.arguments_sent
        for index, (name, arguments) in enumerate(calls):
            if index == len(sent):
                pieces.append({"index": index, **new_tool_call(name, arguments)})
                sent.append(len(arguments))
            elif rest := arguments[sent[index] :]:
                pieces.append({"index": index, "function": {"arguments": rest}})
                sent[index] = len(arguments)
        return pieces

    def last_delta(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """The last chunk's delta when the output is parsed whole: the reasoning, content and
        tool calls not sent yet (each call with its index), with the finish reason. Calls
        begun while streaming are kept, their arguments finished as written: the output is a
        tool call answer even if the rest of it holds no valid call (finish reason
        "tool_calls", unless a call was cut short)."""
        body, finish_reason = self.answer(choice)
        delta: dict[str, Any] = {}
        if rest := (body.get("reasoning") or "")[choice.reasoning_sent :]:
            delta.update(reasoning=rest, reasoning_content=rest)
        found = [
            (call["function"]["name"], call["function"]["arguments"])
            for call in body.get("tool_calls", [])
        ]
        content, calls = body["content"] or "", found
        if choice.arguments_sent:
            content = choice.text
            if self.reasoning_parser is not None:
                split = split_reasoning(self.reasoning_parser, content, finished=True)
                content = split.content(content) or ""
            parser = self.auto_tool_call_parser()
            begun = calls_so_far(parser, content)
            content = content[: content_end(parser, content)]
            calls = [(call.name, call.arguments) for call in begun] + found[len(begun) :]
            if all(call.complete for call in begun):
                finish_reason = "tool_calls"
        if rest := content[choice.content_sent :]:
            delta["content"] = rest
        if pieces := self.call_pieces(choice, calls):
            delta["tool_calls"] = pieces
        return delta, finish_reason


def new_tool_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI tool call, with an id of its own."""
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def check_error(delta: SequenceDelta) -> None:
    if delta.finish_reason == "error":
        raise ClientError(delta.error or "the request failed", delta.error_status)


class LatencyTracker:
    """Feeds TTFT, inter-token and end-to-end latency of one response into the metrics."""

    def __init__(self, metrics: WorkerMetrics, model_name: str, arrival: float) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.arrival = arrival
        self.last_token_time: float | None = None

    def observe(self, delta: SequenceDelta) -> None:
        if not delta.token_ids:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.metrics.ttft.labels(self.model_name).observe(now - self.arrival)
        else:
            self.metrics.itl.labels(self.model_name).observe(now - self.last_token_time)
        self.last_token_time = now
        self.metrics.generation_tokens.labels(self.model_name).inc(len(delta.token_ids))

    def finish(self, choices) -> None:
        self.metrics.e2e.labels(self.model_name).observe(time.monotonic() - self.arrival)
        for choice in choices:
            self.metrics.requests.labels(self.model_name, choice.finish_reason or "abort").inc()
