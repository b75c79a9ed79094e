"""Who may call the HTTP servers (the router and the workers): API keys, the cluster token and
browser origins.

A server given a key (`--api-key`, else the environment variable `TANDEM_API_KEY`, as vLLM reads
`VLLM_API_KEY`) wants `Authorization: Bearer <key>` on every endpoint but its open ones (health,
version and metrics: for probes and scrapers), and answers OpenAI's 401 without it. A server
given `--allowed-origins` answers browsers' cross-origin (CORS) requests from those origins;
without it, none (vLLM allows every origin unless told otherwise).

The cluster token (`--cluster-token`, else `TANDEM_CLUSTER_TOKEN`) is the one secret the router
and the workers of a cluster share. A request that carries it as its bearer is "from the
cluster": it passes a worker's API-key check too, and only such requests may set the PD fields
(`kv_transfer_params`) or call `POST /v1/kv/release` on a worker that has a token. tandem's
router sends it to its workers (the API key when it has no token). Secrets are compared in
constant time.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Collection

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

API_KEY_ENV = "TANDEM_API_KEY"
CLUSTER_TOKEN_ENV = "TANDEM_CLUSTER_TOKEN"
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})
API_KEY_HELP = (
    "require 'Authorization: Bearer KEY' on every endpoint but /health, /version and /metrics "
    f"(default: the environment variable {API_KEY_ENV}, which keeps the key out of process lists)"
)
ALLOWED_ORIGINS_HELP = (
    "answer browsers' cross-origin (CORS) requests from these origins, or * for any (default: none)"
)


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def cluster_token_from_env() -> str | None:
    return os.environ.get(CLUSTER_TOKEN_ENV) or None


def bearer_matches(headers: Headers, secret: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    # As bytes (a header's, which Starlette decodes as latin-1): compare_digest refuses str
    # with non-ASCII characters, which a header may hold.
    presented = token.strip().encode("latin-1")
    return scheme.lower() == "bearer" and secrets.compare_digest(presented, secret.encode())


def from_cluster(headers: Headers, cluster_token: str | None) -> bool:
    """Whether a request carries the cluster token as its bearer (never, without a token)."""
    return cluster_token is not None and bearer_matches(headers, cluster_token)


class RequireApiKey:
    """ASGI middleware: the app's HTTP requests pass only with the key (or the cluster token,
    when given one), but on open paths. A server without a key adds none (`guard`), so its
    requests pay nothing for it."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        open_paths: Collection[str] = OPEN_PATHS,
        cluster_token: str | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = frozenset(open_paths)
        self.cluster_token = cluster_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if bearer_matches(headers, self.api_key) or from_cluster(headers, self.cluster_token):
            await self.app(scope, receive, send)
            return
        error = {
            "message": "a valid API key is required: send it as 'Authorization: Bearer <key>'",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        refusal = JSONResponse({"error": error}, 401, headers={"www-authenticate": "Bearer"})
        await refusal(scope, receive, send)


def guard(
    app: Starlette,
    api_key: str | None,
    open_paths: Collection[str] = OPEN_PATHS,
    allowed_origins: Collection[str] = (),
    cluster_token: str | None = None,
) -> None:
    """Make `app` want `api_key` (or `cluster_token`, a worker's) on all but `open_paths` (with
    no key, leave it open), and answer cross-origin requests from `allowed_origins` (a layer
    outside the key's: a browser's preflight request carries no key)."""
    if api_key:
        app.add_middleware(
            RequireApiKey, api_key=api_key, open_paths=open_paths, cluster_token=cluster_token
        )
    if allowed_origins:
        origins = list(allowed_origins)
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"]
        )
