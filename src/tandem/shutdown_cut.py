"""What a server's shutdown deadline cuts ends in words, not with a dropped connection.

On SIGTERM uvicorn gives the requests in flight a grace period, then cancels their tasks: a
stream would stop mid-answer and a request not answered yet would lose its connection with no
answer. `EndCutAnswers` wraps an ASGI app (the router's, a worker's). A request whose task is
cancelled (the deadline: nothing else in these servers cancels a request's task) ends, for a
client still there, with a 503 and the given error body if no byte of its answer was sent, or
with that error as an event and `[DONE]` in a stream; a JSON answer already begun is left cut,
since it cannot be ended well. The task then ends normally: no cancellation traceback in the log.
What the app cleans up on cancellation (aborting the request's engine work, a relay's legs) runs
first, as the cancellation passes through it.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SSE_MEDIA_TYPE = b"text/event-stream"


class EndCutAnswers:
    """ASGI middleware: an answer the server's shutdown cuts ends with `error_body` (the JSON of
    `{"error": <OpenAI's error object>}`) as described above."""

    def __init__(self, app: ASGIApp, error_body: bytes) -> None:
        self.app = app
        self.error_body = error_body
        self.error_events = b"data: " + error_body + b"\n\ndata: [DONE]\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answer = AnswerState()

        async def watched_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                answer.client_left = True
            return message

        async def watched_send(message: Message) -> None:
            answer.saw(message)
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        except asyncio.CancelledError:
            if not answer.client_left and not answer.finished:
                await self._end(answer, send)

    async def _end(self, answer: AnswerState, send: Send) -> None:
        if answer.media_type is None:
            start = {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"application/json")],
            }
            ending = [start, {"type": "http.response.body", "body": self.error_body}]
        elif answer.media_type.startswith(SSE_MEDIA_TYPE):
            ending = [{"type": "http.response.body", "body": self.error_events}]
        else:
            return
        with contextlib.suppress(OSError):  # the client left meanwhile
            for message in ending:
                await send(message)


class AnswerState:
    """What of one answer has gone out."""

    def __init__(self) -> None:
        self.media_type: bytes | None = None  # once its head is sent
        self.finished = False
        self.client_left = False

    def saw(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            self.media_type = headers.get(b"content-type", b"")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
