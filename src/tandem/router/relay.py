"""The byte-level pieces of relaying: SSE in and out, error bodies, and the ASGI response.

A request's flow is an async generator that yields one `ResponseHead` and then body chunks
(bytes). `RelayResponse` sends the head only once the flow produced it, so a flow can still pick
the status (relay a worker's 4xx, retry on another worker) until its first byte; and it watches
the client connection the whole time: when the client goes away it cancels the flow wherever it
is waiting (prefill leg, decode leg, between the two), and the flow's cleanup aborts both legs,
as it does when the server cancels the response (its shutdown's deadline; `shutdown_cut`).
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

    async def _stream(self, send: Send) -> None:
        head = await anext(self.flow)
        assert isinstance(head, ResponseHead), "a flow yields its head first"
        self.status_code = head.status
        await send(
            {"type": "http.response.start", "status": head.status, "headers": head.raw_headers()}
        )
        async for chunk in self.flow:
            assert isinstance(chunk, bytes)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _wait_for_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        disconnect = asyncio.ensure_future(self._wait_for_disconnect(receive))
        try:
            await asyncio.wait((stream, disconnect), return_when=asyncio.FIRST_COMPLETED)
        finally:  # a cancellation (the shutdown's deadline) too: `EndCutAnswers` ends the answer
            for task in (stream, disconnect):
                task.cancel()
            await asyncio.gather(stream, disconnect, return_exceptions=True)
            await self.flow.aclose()
        if stream.done() and not stream.cancelled():
            error = stream.exception()
            if error is not None and not isinstance(error, OSError):  # OSError: the client left
                raise error
