"""The router's HTTP surface: the OpenAI endpoints, health, metrics and worker registration.

The two proxied endpoints (`/v1/completions`, `/v1/chat/completions`) are served by a thin ASGI
layer in front of FastAPI (`ProxiedRoutes`); the rest are FastAPI routes. `/tokenize` and
`/detokenize` go to any worker (all serve the same model).

With an API key (`tandem.access`), every endpoint needs `Authorization: Bearer <key>` but
`/health`, `/version` and `/metrics` (for probes and scrapers) and the registration endpoints,
which need the cluster token instead and are refused outright when the router has none. The
router sends the cluster token to its workers (its API key, which they share, when it has no
token).
The PD fields (`kv_transfer_params`) are the router's to set: they are taken out of every client
body as it arrives, whatever flow then serves it (a decode worker would otherwise load whatever
KV, from wherever, a client's fields named). The router checks the fields it reads itself
(`stream`; `stop`, which a PD flow reads for its hold-back); the workers check the rest.
The router runs one health round before it serves, so static workers that are up are in the pool
from the first request on; a registering worker joins once its own health check passes.
`/v1/models` lists the workers' own model entries (created, max_model_len). An unknown path (404)
or method (405) is answered with an OpenAI error object too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import tandem
from tandem.access import OPEN_PATHS, bearer_matches, guard
from tandem.http_options import route_error_message
from tandem.limits import BodyLimit, BodyLimits, RequestRefused, decode_json
from tandem.router.config import Role, RouterConfig
from tandem.router.metrics import RouterMetrics
from tandem.router.proxy import Proxy
from tandem.router.relay import RelayResponse, error_body
from tandem.router.workers import WorkerPool

PROXIED_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
PD_FIELDS = ("kv_transfer_params",)  # set by the router on the legs, never by a client
REGISTRATION_PATHS = frozenset(
    {"/internal/workers/register", "/internal/workers/heartbeat", "/internal/workers/deregister"}
)


class WorkerAnnouncement(BaseModel):
    """The body of register, heartbeat and deregister calls."""

    model_config = ConfigDict(extra="ignore")
    url: str
    role: Role = "both"
    model: str | None = None


def error_response(status: int, message: str, code: str, error_type: str) -> Response:
    return Response(error_body(message, error_type, code), status, media_type="application/json")


def route_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's answer for a path it does not know (404) or a method the path does not take
    (405), as an OpenAI error object."""
    message, code = route_error_message(
        request.method, request.url.path, exc.status_code, exc.headers, exc.detail
    )
    code = code or str(exc.status_code)
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    response = error_response(exc.status_code, message, code, error_type)
    response.headers.update(exc.headers or {})
    return response


def parse_request_body(
    raw: bytes, max_json_depth: int = BodyLimits.max_json_depth
) -> dict[str, Any] | Response:
    """A proxied request's JSON object without PD fields, or the 400 answer that says what is
    wrong with it."""
    try:
        body = decode_json(raw, msgspec.json.decode, max_json_depth)
    except RequestRefused as refusal:
        return error_response(
            refusal.status, refusal.message, refusal.code, "invalid_request_error"
        )
    except ValueError:  # msgspec.DecodeError, malformed UTF-8 included
        message = "the request body is not valid JSON"
        return error_response(400, message, "invalid_json", "invalid_request_error")
    if not isinstance(body, dict):
        message = "the request body must be a JSON object"
        return error_response(400, message, "invalid_json", "invalid_request_error")
    if not isinstance(body.get("stream", False), bool):
        message = "'stream' must be true or false"
        return error_response(400, message, "invalid_stream", "invalid_request_error")
    stop = body.get("stop")  # read by a PD flow before any worker checks the body
    if not (
        stop is None
        or isinstance(stop, str)
        or (isinstance(stop, list) and all(isinstance(each, str) for each in stop))
    ):
        message = "'stop' must be a string or a list of strings"
        return error_response(400, message, "invalid_stop", "invalid_request_error")
    for name in PD_FIELDS:
        body.pop(name, None)
    return body


class ProxiedRoutes:
    """ASGI middleware: the two OpenAI POSTs go straight to the proxy; all else to the app.

    A lone streamed request pays for every layer between the HTTP server and the proxy;
    FastAPI's routing, dependency solving and per-message exception wrappers were about a fifth
    of the time the router added on loopback, so these two endpoints skip them.
    """

    def __init__(self, app: ASGIApp, proxy: Proxy, max_json_depth: int) -> None:
        self.app = app
        self.proxy = proxy
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = PROXIED_PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        answer = await self._answer(scope, receive, endpoint)
        if answer is not None:
            await answer(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, endpoint: str) -> Response | None:
        """The response to send, or None when the client left before its body arrived."""
        if scope["method"] != "POST":
            message = f"{scope['path']} takes POST only"
            response = error_response(405, message, "method_not_allowed", "invalid_request_error")
            response.headers["allow"] = "POST"
            return response
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = parse_request_body(b"".join(chunks), self.max_json_depth)
        if isinstance(body, Response):
            return body
        return RelayResponse(self.proxy.handle(endpoint, body))


def create_app(config: RouterConfig) -> FastAPI:
    metrics = RouterMetrics()
    pool = WorkerPool(config, metrics)
    proxy = Proxy(config, pool, metrics)
    checks: set[asyncio.Future[None]] = set()  # health checks of registering workers

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        await pool.check_all(proxy.session)
        health_checks = asyncio.ensure_future(pool.run_health_checks(proxy.session))
        try:
            yield
        finally:
            health_checks.cancel()
            await asyncio.gather(health_checks, return_exceptions=True)
            await proxy.close()

    app = FastAPI(title="tandem router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pool = pool
    app.state.proxy = proxy
    app.state.metrics = metrics
    app.add_middleware(ProxiedRoutes, proxy=proxy, max_json_depth=config.body_limits.max_json_depth)
    app.add_middleware(BodyLimit, max_bytes=config.body_limits.max_bytes)  # inside the key check
    guard(app, config.api_key, OPEN_PATHS | REGISTRATION_PATHS, config.allowed_origins)

    def refuse_without_cluster_token(request: Request) -> Response | None:
        if config.cluster_token is None:
            message = "worker registration is off: start the router with --cluster-token"
            return error_response(403, message, "registration_disabled", "permission_error")
        if not bearer_matches(request.headers, config.cluster_token):
            message = "the cluster token is missing or wrong"
            return error_response(401, message, "invalid_cluster_token", "invalid_request_error")
        return None

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return route_error(request, exc)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": pool.model_cards()})

    @app.post("/tokenize")
    @app.post("/detokenize")
    async def tokenizer_endpoints(request: Request) -> Response:
        status, media_type, data = await proxy.forward(request.url.path, await request.body())
        return Response(data, status, media_type=media_type)

    @app.get("/health")
    async def health() -> Response:
        counts = pool.counts()
        can_serve = counts["decode"] > 0 or counts["both"] > 0
        status = "ok" if can_serve else "no decode or both worker is healthy"
        return JSONResponse({"status": status, "workers": counts}, 200 if can_serve else 503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": tandem.__version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/internal/workers")
    async def list_workers() -> Response:
        return JSONResponse({"workers": [worker.describe() for worker in pool.workers()]})

    async def announcement(request: Request) -> WorkerAnnouncement | Response:
        refusal = refuse_without_cluster_token(request)
        if refusal is not None:
            return refusal
        try:
            return WorkerAnnouncement.model_validate_json(await request.body())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "body"
            message = f"bad worker announcement: {where}: {first['msg']}"
            return error_response(400, message, "invalid_announcement", "invalid_request_error")

    @app.post("/internal/workers/register")
    @app.post("/internal/workers/heartbeat")
    async def register(request: Request) -> Response:
        worker = await announcement(request)
        if isinstance(worker, Response):
            return worker
        known = pool.register(worker.url, worker.role, worker.model)
        if not known.healthy:
            checks.add(asyncio.ensure_future(pool.check(proxy.session, known)))
            checks.difference_update([check for check in checks if check.done()])
        return JSONResponse({"registered": known.describe()})

    @app.post("/internal/workers/deregister")
    async def deregister(request: Request) -> Response:
        worker = await announcement(request)
        if isinstance(worker, Response):
            return worker
        return JSONResponse({"deregistered": pool.deregister(worker.url)})

    return app
