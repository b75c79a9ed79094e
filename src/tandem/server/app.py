"""The worker's HTTP server: the routes of the OpenAI API over one engine, plus health, models,
metrics and the PD extensions (kv_transfer_params in and out, `POST /v1/kv/release`).

A route only wires: `openai/validation.py` checks a request and makes its engine inputs,
`openai/serving.py` runs it, and the completion and chat writers (`openai/completions.py`,
`openai/chat.py`) write its answer. A worker with a cluster token takes PD fields and KV
releases only from the cluster (`tandem.access`; 403 otherwise); the engine client checks the
fields themselves (`tandem.kv.params`; 400) before the engine sees the request.

Every error a client can cause is an OpenAI-style error object with a 4xx status (an unknown
path or method too); a 5xx means a bug. A client that disconnects aborts its request in the
engine at once. With an API key, every endpoint but /health, /version and /metrics needs it
(`tandem.access`).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

import tandem
from tandem.access import guard
from tandem.http_options import route_error_message
from tandem.limits import limit_fastapi_bodies
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.metrics import WorkerMetrics
from tandem.server.openai.chat import ChatWriter
from tandem.server.openai.chat_request import ChatCompletionRequest, TokenizeRequest
from tandem.server.openai.completion_request import CompletionRequest
from tandem.server.openai.completions import CompletionWriter
from tandem.server.openai.protocol import (
    ClientError,
    DetokenizeRequest,
    KVReleaseRequest,
    error_body,
)
from tandem.server.openai.serving import Responder
from tandem.server.openai.validation import RequestInputs
from tandem.server.settings import ServerSettings


def error_response(
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
    inputs = RequestInputs(client, settings)
    add_error_handlers(app)
    add_status_routes(app, inputs, metrics)
    add_openai_routes(app, inputs, Responder(client, metrics, settings.served_model_name))
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal as OpenAI's error object: a body that does not validate, a `ClientError`,
    an unknown path (404) or a method its path does not take (405)."""

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response("the request body is not valid JSON", 400)
        location = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        return error_response(f"{location or 'body'}: {message}", 400, location or None)

    @app.exception_handler(ClientError)
    async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
        return error_response(str(exc), exc.status, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _route_error(request: Request, exc: HTTPException) -> JSONResponse:
        message, code = route_error_message(
            request.method, request.url.path, exc.status_code, exc.headers, exc.detail
        )
        response = error_response(message, exc.status_code, code=code)
        response.headers.update(exc.headers or {})
        return response


def add_status_routes(app: FastAPI, inputs: RequestInputs, metrics: WorkerMetrics) -> None:
    """/health, /version, /v1/models, /metrics and the router's /v1/kv/release."""
    client, settings = inputs.client, inputs.settings

    @app.get("/health")
    async def health() -> Response:
        if client.healthy:
            return JSONResponse(
                {
                    "status": "ok",
                    "role": settings.role,
                    "kv": kv_endpoint(client, settings),
                    # the router's conditional PD and planner read it
                    "load": metrics.load_report(time.monotonic()),
                }
            )
        return error_response("the engine is not running", 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tandem.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tandem",
            "max_model_len": client.info.max_model_len,
        }
        return {"object": "list", "data": [{"id": name, **card} for name in settings.served_names]}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/kv/release")
    async def release_kv(body: KVReleaseRequest, raw: Request) -> dict[str, Any]:
        message = "KV leases are released by the cluster's router, not by clients"
        inputs.require_cluster(raw, message, "kv_release_forbidden")
        if not await client.release_kv(body.remote_request_id):
            raise ClientError(
                f"no KV lease {body.remote_request_id!r} is held here: it was released, it "
                "expired, or this worker never handed it out",
                404,
                "remote_request_id",
            )
        return {"released": body.remote_request_id}


def kv_endpoint(client: AsyncEngineClient, settings: ServerSettings) -> dict[str, Any] | None:
    """What a router needs to hand a decode leg off before the prefill answers: the transport,
    and where a decode worker waits for this (prefill) worker's announcement."""
    if settings.kv_transport is None:
        return None
    endpoint: dict[str, Any] = {"transport": settings.kv_transport, "handoff": True}
    if client.info.kv_port is not None:
        endpoint.update(host=settings.kv_host, port=client.info.kv_port)
        endpoint["engine_id"] = client.info.kv_engine_id
    return endpoint


def add_openai_routes(app: FastAPI, inputs: RequestInputs, responder: Responder) -> None:
    """/v1/completions, /v1/chat/completions, /tokenize and /detokenize."""
    client, settings = inputs.client, inputs.settings

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        inputs.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ClientError("send either prompt or messages")
        if body.messages is not None:
            add_special_tokens = bool(body.add_special_tokens)
            token_ids = await inputs.tokenize_messages(body.messages, body, add_special_tokens)
        else:
            token_ids = await inputs.tokenize(body.prompt, body.add_special_tokens is not False)
        token_strs = None
        if body.return_token_strs:
            tokenizer = inputs.require_tokenizer("return_token_strs")
            token_strs = tokenizer.convert_ids_to_tokens(token_ids)
        return {
            "count": len(token_ids),
            "max_model_len": client.info.max_model_len,
            "tokens": token_ids,
            "token_strs": token_strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        inputs.check_model(body.model)
        try:
            client.inputs.check_token_ids(body.tokens, "tokens")
        except ValueError as exc:
            raise ClientError(str(exc), param="tokens") from exc
        return {"prompt": inputs.require_tokenizer("tokens").decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        inputs.check_generation(body, raw)
        prompts = body.prompts()
        inputs.check_num_sequences(len(prompts), body.n)
        prompt_ids = [await inputs.tokenize(p, body.add_special_tokens) for p in prompts]
        if body.kv_transfer_params and len(prompts) != 1:
            raise ClientError("a PD request must hold exactly one prompt", param="prompt")
        base_id = client.new_request_id()
        params = await inputs.sampling_params(body, body.logprobs)
        writer = CompletionWriter(client, settings, body, f"cmpl-{base_id}", prompts, prompt_ids)
        request_ids = [f"{base_id}-p{i}" for i in range(len(prompts))]
        return await responder.respond(
            raw, body, list(zip(request_ids, prompt_ids, strict=True)), params, writer
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        inputs.check_generation(body, raw)
        inputs.check_tool_choice(body)
        prompt_ids = await inputs.tokenize_messages(body.messages, body, body.add_special_tokens)
        base_id = client.new_request_id()
        writer = ChatWriter(client, settings, body, f"chatcmpl-{base_id}", [prompt_ids])
        params = await inputs.sampling_params(
            body, body.num_logprobs(), writer.structured_output_after
        )
        return await responder.respond(raw, body, [(base_id, prompt_ids)], params, writer)
