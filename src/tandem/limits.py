"""Request limits of the two HTTP servers (the worker's and the router's): how large a body may
be and how deep its JSON may nest, enforced before the body is parsed or believed; and the
values of the worker's limits on single fields, so that both CLIs declare every limit here.

* `BodyLimit` (ASGI middleware) answers a body over `max_bytes` with a 413: by its
  Content-Length before a byte of it is read, else by counting the bytes as they arrive
  (chunked). A body within the limit reaches the app whole, as one message.
* `decode_json` parses a body and refuses (400) one that nests deeper than `max_json_depth`.
  The decoders recurse in C under the interpreter's recursion limit, so a far deeper body
  raises RecursionError, which is the same 400; a depth within that is measured on the decoded
  value, only when the body holds more brackets than the limit.
* `limit_fastapi_bodies` puts both on a FastAPI app (the worker): every route parses its JSON
  body through `decode_json`, and `RequestRefused` becomes an OpenAI error object.

Each refusal is an OpenAI error object with a sentence naming the flag that sets the limit.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

# ASGI's callables (as starlette.types spells them; this module imports no web framework, so
# that the CLIs, which declare the limits' flags, load fast)
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]

MIB = 1024 * 1024
# The decoders (json, msgspec) recurse about 1000 levels before RecursionError: a limit well
# below that is what a refusal reports.
MAX_JSON_DEPTH_CEILING = 512


@dataclass(frozen=True)
class BodyLimits:
    """Both servers' limits on a request body."""

    max_bytes: int = 32 * MIB
    max_json_depth: int = 128


@dataclass(frozen=True)
class FieldLimits:
    """The worker's limits on fields whose size costs the engine or the front end per step."""

    max_structured_output_bytes: int = 64 * 1024
    max_structured_output_repetition: int = 10_000
    max_stop_strings: int = 256
    max_logit_bias: int = 1024


def add_body_limit_arguments(parser: argparse._ActionsContainer) -> None:
    defaults = BodyLimits()
    parser.add_argument(
        "--max-request-body-bytes",
        type=positive_int,
        default=defaults.max_bytes,
        metavar="BYTES",
        help="largest request body taken, in bytes; a larger one is a 413 before it is read "
        f"(default: {defaults.max_bytes // MIB} MiB: a full context of text or token ids is "
        "well under 1 MiB even at 128k tokens, so this leaves room for batches of prompts, "
        "long conversations and tool lists, while bounding the memory and parse time one "
        "request can cost)",
    )
    parser.add_argument(
        "--max-request-json-depth",
        type=json_depth,
        default=defaults.max_json_depth,
        metavar="LEVELS",
        help="deepest nesting of a request body's JSON arrays and objects; a deeper body is a "
        f"400 (default: {defaults.max_json_depth}, the JSON schema compiler's own limit; at "
        f"most {MAX_JSON_DEPTH_CEILING})",
    )


def body_limits_from_args(args: argparse.Namespace) -> BodyLimits:
    return BodyLimits(args.max_request_body_bytes, args.max_request_json_depth)


def add_field_limit_arguments(parser: argparse._ActionsContainer) -> None:
    defaults = FieldLimits()
    parser.add_argument(
        "--max-structured-output-bytes",
        type=positive_int,
        default=defaults.max_structured_output_bytes,
        metavar="BYTES",
        help="largest structured-output constraint: a JSON schema (as JSON, a forced tool "
        "call's tools together), a regex, a grammar, or a choice's strings together "
        f"(default: {defaults.max_structured_output_bytes // 1024} KiB; the engine builds a "
        "request's grammar between two steps, in time that grows faster than its size)",
    )
    parser.add_argument(
        "--max-structured-output-repetition",
        type=positive_int,
        default=defaults.max_structured_output_repetition,
        metavar="COUNT",
        help="largest counted repetition in a constraint's regexes ({n}, {m,n}; nested ones "
        f"multiply) (default: {defaults.max_structured_output_repetition}; a{{1000000}} costs "
        "the engine seconds per step)",
    )
    parser.add_argument(
        "--max-stop-strings",
        type=positive_int,
        default=defaults.max_stop_strings,
        metavar="COUNT",
        help="most stop strings a request may give; each is searched for after every token "
        f"(default: {defaults.max_stop_strings})",
    )
    parser.add_argument(
        "--max-logit-bias",
        type=positive_int,
        default=defaults.max_logit_bias,
        metavar="COUNT",
        help="most logit_bias entries a request may give; each is applied at every step "
        f"(default: {defaults.max_logit_bias})",
    )


def field_limits_from_args(args: argparse.Namespace) -> FieldLimits:
    return FieldLimits(
        max_structured_output_bytes=args.max_structured_output_bytes,
        max_structured_output_repetition=args.max_structured_output_repetition,
        max_stop_strings=args.max_stop_strings,
        max_logit_bias=args.max_logit_bias,
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def json_depth(text: str) -> int:
    value = positive_int(text)
    if value > MAX_JSON_DEPTH_CEILING:
        raise argparse.ArgumentTypeError(f"{value} is over {MAX_JSON_DEPTH_CEILING}")
    return value


class RequestRefused(Exception):
    """A request refused for its size or shape: the status, and the OpenAI error's message
    and code."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    def body(self) -> bytes:
        error = {"message": self.message, "type": "invalid_request_error", "param": None}
        return json.dumps({"error": {**error, "code": self.code}}, separators=(",", ":")).encode()

    async def send(self, send: Send) -> None:
        """Answer with this refusal (the request's body left unread)."""
        body = self.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def too_large(limit: int, size: int | None) -> RequestRefused:
    has = f"has {size} bytes" if size is not None else "is longer than that"
    return RequestRefused(
        413,
        f"the request body {has}; this server takes at most {limit} bytes "
        "(--max-request-body-bytes): send a smaller request (shorter or fewer prompts)",
        "request_too_large",
    )


def too_deep(limit: int) -> RequestRefused:
    return RequestRefused(
        400,
        f"the request body nests deeper than {limit} levels of JSON arrays and objects "
        "(--max-request-json-depth): send a flatter body",
        "json_too_deep",
    )


def decode_json(raw: bytes, decode: Callable[[bytes], Any], max_depth: int) -> Any:
    """`decode(raw)`, refused (RequestRefused, 400) when it nests deeper than max_depth; the
    decoder's own errors (malformed JSON) go out as they are."""
    try:
        value = decode(raw)
    except RecursionError:
        raise too_deep(max_depth) from None
    # A body with no more brackets than the limit cannot nest deeper (the common case).
    if raw.count(b"[") + raw.count(b"{") > max_depth and nests_deeper(value, max_depth):
        raise too_deep(max_depth)
    return value


def nests_deeper(value: Any, max_depth: int) -> bool:
    """Whether a decoded JSON value has arrays and objects more than max_depth levels deep; in
    one pass per level over that level's containers (no recursion)."""
    level = [value]  # the values at one depth: the containers among them are a level deeper
    for _ in range(max_depth):
        level = [item for item in level if type(item) is list or type(item) is dict]
        if not level:
            return False
        level = list(chain.from_iterable(v.values() if type(v) is dict else v for v in level))
    return any(type(item) is list or type(item) is dict for item in level)


def content_length(scope: Message) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413, unread if its Content-Length
    says so, else as soon as the bytes received pass the limit; a body within it is passed on
    whole, in one message (later messages, a disconnect, come from the server as they do)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await too_large(self.max_bytes, declared).send(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was in
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_large(self.max_bytes, None).send(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return whole

        await self.app(scope, replay, send)


def limit_fastapi_bodies(app: Any, limits: BodyLimits) -> None:
    """Put the body limits on a FastAPI app, before its routes are declared: the size as
    middleware (inside any added later), and the depth in every route's parse of its JSON
    body, whose refusal is an OpenAI error object."""
    from fastapi.routing import APIRoute
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import Response

    class Refused(HTTPException):  # FastAPI lets an HTTPException out of a body's parse as is
        def __init__(self, refusal: RequestRefused) -> None:
            super().__init__(refusal.status, refusal.message)
            self.refusal = refusal

    class DepthLimitedRequest(Request):
        async def json(self) -> Any:
            if not hasattr(self, "_json"):
                try:
                    body = await self.body()
                    self._json = decode_json(body, json.loads, limits.max_json_depth)
                except RequestRefused as exc:
                    raise Refused(exc) from None
                except UnicodeDecodeError:
                    message = "the request body is not valid JSON: it is not UTF-8 text"
                    raise Refused(RequestRefused(400, message, "invalid_json")) from None
            return self._json

    class DepthLimitedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()

            async def limited(request: Request) -> Response:
                return await handler(DepthLimitedRequest(request.scope, request.receive))

            return limited

    async def refused(request: Request, exc: Refused) -> Response:
        return Response(exc.refusal.body(), exc.status_code, media_type="application/json")

    app.add_middleware(BodyLimit, max_bytes=limits.max_bytes)
    app.router.route_class = DepthLimitedRoute
    app.add_exception_handler(Refused, refused)
