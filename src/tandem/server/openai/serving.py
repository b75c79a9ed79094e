"""How a generating request is served once its inputs are ready: every prompt is submitted and
its first delta awaited before any response byte is written (so admission errors are 4xx
answers, not broken streams), then the prompts' delta streams are merged and written, whole or
as server-sent events.

A client that disconnects cancels everything, the starts included, which aborts its sequences
in the engine at once (a prefill leg's whole work happens before its first token; a handoff's
decode leg waits for it). A request the engine fails before its first token is a 5xx with no
stream; one that fails later ends its stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.engine.processor import SequenceDelta
from tandem.engine.sampling_params import SamplingParams
from tandem.server.engine_client import AsyncEngineClient, EngineDeadError, QueueFullError
from tandem.server.metrics import WorkerMetrics
from tandem.server.openai.protocol import ClientError, SamplingFields
from tandem.server.openai.writer import ResponseWriter, check_error

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


class Responder:
    """Serves one worker's generating requests through its engine client."""

    def __init__(self, client: AsyncEngineClient, metrics: WorkerMetrics, model_name: str) -> None:
        self.client = client
        self.metrics = metrics
        self.model_name = model_name

    async def respond(
        self,
        raw: Request,
        body: SamplingFields,
        prompts: list[tuple[str, list[int]]],
        params: SamplingParams,
        writer: ResponseWriter,
    ) -> Response:
        """Start every prompt (request id, token ids), then answer: streamed, or whole."""
        arrival = time.monotonic()
        starts = [
            functools.partial(self.start, request_id, ids, body, params)
            for request_id, ids in prompts
        ]
        if body.stream:
            # Starting may take long (a handoff's first token comes when the prefill is done):
            # a client that leaves meanwhile aborts it.
            streams = await until_disconnected(raw, start_all(starts))
            if streams is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return StreamingResponse(
                sse(writer.stream(merge(streams), self.metrics, arrival)),
                media_type="text/event-stream",
            )

        async def work() -> dict[str, Any]:
            streams = await start_all(starts)
            return await writer.collect(merge(streams), self.metrics, arrival)

        result = await until_disconnected(raw, work())
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(result)

    async def start(
        self, request_id: str, prompt_ids: list[int], body: SamplingFields, params: SamplingParams
    ) -> PrimedStream:
        """Submit one prompt and return its delta stream, primed: admission errors surface
        here as ClientErrors, before any response byte is written."""
        try:
            stream = self.client.generate(request_id, prompt_ids, params, body.kv_transfer_params)
            first = await anext(stream)
        except (QueueFullError, EngineDeadError) as exc:
            raise ClientError(str(exc), 503) from exc
        except ValueError as exc:  # KVParamsError names its field
            raise ClientError(str(exc), param=getattr(exc, "param", None)) from exc
        if first.finish_reason == "error":  # failed before its first token: a 5xx, no stream
            await stream.aclose()
            check_error(first)
        self.metrics.prompt_tokens.labels(self.model_name).inc(len(prompt_ids))
        return PrimedStream(first, stream)


async def start_all(starts: list[Callable[[], Awaitable[PrimedStream]]]) -> list[PrimedStream]:
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
