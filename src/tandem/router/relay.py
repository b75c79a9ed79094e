"""The byte-level pieces of relaying: SSE in and out, error bodies, and the ASGI response.

A request's flow is an async generator that yields one `ResponseHead` and then body chunks
(bytes). `RelayResponse` sends the head only once the flow produced it, so a flow can still pick
the status (relay a worker's 4xx, retry on another worker) until its first byte; and it watches
the client connection the whole time: when the client goes away it cancels the flow wherever it
is waiting (prefill leg, decode leg, between the two), and the flow's cleanup aborts both legs.
A response the server cancels (its shutdown's deadline) ends in words: a 503 before its head, an
error event and `[DONE]` in a stream (a whole JSON answer cut midway is left cut).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"
SHUTTING_DOWN = "the router is shutting down and cut this request short; retry"


@dataclass(frozen=True)
class ResponseHead:
    status: int
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        raw = [(b"content-type", self.media_type.encode())]
        raw.extend((name.encode(), value.encode()) for name, value in self.headers.items())
        return raw


JSON_HEAD = ResponseHead(200, "application/json")
SSE_HEAD = ResponseHead(200, "text/event-stream; charset=utf-8", SSE_HEADERS)


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    """An OpenAI error object."""
    error = {"message": message, "type": error_type, "param": param, "code": code}
    return msgspec.json.encode({"error": error})


def error_event(message: str, code: str) -> bytes:
    """The SSE events that end a stream which failed after its first byte."""
    error = {"message": message, "type": "server_error", "param": None, "code": code}
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\n" + DONE_EVENT


def sse_event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


async def iter_sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The `data` payloads of an SSE byte stream, one per event, in order."""
    buffer = b""
    async for chunk in chunks:
        buffer = (buffer + chunk).replace(b"\r\n", b"\n")
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            data = [
                line[5:].removeprefix(b" ") for line in event.split(b"\n") if line[:5] == b"data:"
            ]
            if data:
                yield b"\n".join(data)


class RelayResponse(Response):
    """Streams a flow's head and chunks; a client disconnect cancels the flow."""

    def __init__(self, flow: AsyncGenerator[ResponseHead | bytes, None]) -> None:
        self.flow = flow
        self.background = None
        self.status_code = 200
        self.head_sent: ResponseHead | None = None

    async def _stream(self, send: Send) -> None:
        head = await anext(self.flow)
        assert isinstance(head, ResponseHead), "a flow yields its head first"
        self.status_code = head.status
        await send(
            {"type": "http.response.start", "status": head.status, "headers": head.raw_headers()}
        )
        self.head_sent = head
        async for chunk in self.flow:
            assert isinstance(chunk, bytes)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _end_cut(self, send: Send) -> None:
        """Says to a client still there that its answer was cut: a 503 if nothing was sent yet,
        an error event and [DONE] ending a stream."""
        if self.head_sent is None:
            start = ResponseHead(503, "application/json")
            body = error_body(SHUTTING_DOWN, "server_error", "router_shutting_down")
        elif self.head_sent.media_type.startswith("text/event-stream"):
            start, body = None, error_event(SHUTTING_DOWN, "router_shutting_down")
        else:
            return
        try:
            if start is not None:
                headers = start.raw_headers()
                await send(
                    {"type": "http.response.start", "status": start.status, "headers": headers}
                )
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError:  # the client left meanwhile
            pass

    @staticmethod
    async def _wait_for_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        disconnect = asyncio.ensure_future(self._wait_for_disconnect(receive))
        cut = False
        try:
            await asyncio.wait((stream, disconnect), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server's shutdown deadline, the one canceller:
            cut = True  # the answer is ended below, and so is the task (no error to log)
        finally:
            client_left = disconnect.done()
            for task in (stream, disconnect):
                task.cancel()
            await asyncio.gather(stream, disconnect, return_exceptions=True)
            if cut and not client_left:
                await self._end_cut(send)
            await self.flow.aclose()
        if stream.done() and not stream.cancelled():
            error = stream.exception()
            if error is not None and not isinstance(error, OSError):  # OSError: the client left
                raise error
