"""The HTTP server flags the worker and the router share, with vLLM's names: `--root-path`,
`--ssl-keyfile` / `--ssl-certfile`, `--disable-log-requests` and `--timeout-keep-alive`; what
they become in uvicorn's settings, and the middleware that serves an app under a root path.

* Root path: vLLM hands it to uvicorn, whose app then expects a proxy in front to strip the
  prefix. tandem serves both ways: a request under the prefix (a client straight, or a proxy
  that passes the prefix on) has it stripped here, one without it (the proxy stripped it) goes
  through as it is; `/health` and the other open paths stay open either way.
* Request logs: one access line per request (uvicorn's), unless `--disable-log-requests` (or
  vLLM's other name for it, `--disable-uvicorn-access-log`); probes and scrapes (`/health`,
  `/metrics`, a router's once a second per worker) log none.
* TLS: uvicorn serves HTTPS with the two files; one without the other is refused.
* Keep-alive: an idle client connection is closed after `--timeout-keep-alive` seconds,
  uvicorn's name (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE). The default is longer than the idle
  time after which common clients and proxies drop a pooled connection themselves (httpx and
  the openai client 5 s, aiohttp 15 s, nginx's upstream pool and AWS's load balancer 60 s): a
  server that closes first can close a connection just as the client sends a request on it,
  which then fails without an answer (uvicorn's 5 s, equal to httpx's, did so under load).

Imports only argparse at import time, so that the CLIs load fast.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable, Callable
from typing import Any

# ASGI's callables (as starlette.types spells them)
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]

KEEP_ALIVE_S = 75.0  # nginx's server default: above the pools and load balancers named above


def add_http_arguments(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--root-path",
        default="",
        metavar="PREFIX",
        help="serve under this path prefix (/v1/models as PREFIX/v1/models), for a proxy that "
        "routes by path, whether it strips the prefix or passes it on",
    )
    parser.add_argument(
        "--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key"
    )
    parser.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="FILE",
        help="serve HTTPS with this certificate (chain), beside --ssl-keyfile",
    )
    add_keep_alive_argument(parser)
    add_request_log_argument(parser)


def positive_seconds(text: str) -> float:
    seconds = float(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0")
    return seconds


def add_keep_alive_argument(
    parser: argparse._ActionsContainer, default: float | None = KEEP_ALIVE_S, whose: str = ""
) -> None:
    parser.add_argument(
        "--timeout-keep-alive",
        type=positive_seconds,
        default=default,
        metavar="SECONDS",
        help=f"close an idle client connection after this long{whose} (default "
        f"{KEEP_ALIVE_S:g}: longer than clients and proxies keep an idle connection, so none "
        "is closed as they send on it)",
    )


def add_request_log_argument(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        dest="disable_log_requests",
        action="store_true",
        help="log no line per request (by default each request logs one: client, method, "
        "path, status)",
    )


def check_http_args(args: argparse.Namespace, command: str) -> None:
    """Refuse, with a sentence, the flags that cannot work together."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SystemExit(f"tandem {command}: give --ssl-keyfile and --ssl-certfile together")
    if args.root_path and not args.root_path.startswith("/"):
        raise SystemExit(
            f"tandem {command}: --root-path {args.root_path!r} must start with /, as /tandem"
        )


PROBE_PATHS = ("/health", "/metrics", "/internal/workers/heartbeat")  # also under a root path


class SkipProbes(logging.Filter):
    """Drops uvicorn's access lines of probes and scrapes: args (client, method, path, ...)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            return not str(args[2]).partition("?")[0].endswith(PROBE_PATHS)
        return True


def quiet_probes() -> None:
    """Keep probes and scrapes out of the access log (call before uvicorn configures it: the
    filter stays on the logger through its configuration)."""
    logging.getLogger("uvicorn.access").addFilter(SkipProbes())


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's settings for these flags (the root path aside: see `RootPath`)."""
    return {
        "access_log": not args.disable_log_requests,
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "timeout_keep_alive": args.timeout_keep_alive,
    }


def url_scheme(args: argparse.Namespace) -> str:
    return "https" if args.ssl_certfile else "http"


class RootPath:
    """ASGI middleware: serves `app` under `root_path` (as `scope["root_path"]`): a path under
    the prefix loses it, any other path goes through as it is."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
            path, raw_path = scope["path"], scope.get("raw_path")
            if path == self.root_path or path.startswith(self.root_path + "/"):
                scope["path"] = path[len(self.root_path) :] or "/"
                if raw_path is not None and raw_path.startswith(self.root_path.encode()):
                    scope["raw_path"] = raw_path[len(self.root_path) :] or b"/"
        await self.app(scope, receive, send)


def under_root_path(app: ASGIApp, root_path: str) -> ASGIApp:
    return RootPath(app, root_path) if root_path.rstrip("/") else app


def route_error_message(
    method: str, path: str, status: int, headers: dict[str, str] | None, detail: object
) -> tuple[str, str | None]:
    """The message and code of an OpenAI error object for Starlette's answer to a path it does
    not know (404) or a method the path does not take (405)."""
    where = f"{method} {path}"
    if status == 404:
        return f"{where}: no such endpoint; the OpenAI API is under /v1", "not_found"
    if status == 405:
        allowed = (headers or {}).get("Allow", "another method")
        return f"{where}: this endpoint takes {allowed}", "method_not_allowed"
    return f"{where}: {detail}", None
