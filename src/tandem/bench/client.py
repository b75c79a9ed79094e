"""The benchmark's HTTP client: one streamed OpenAI request in, one `RequestRecord` out.

Timing invariants:
* `start_time` is taken just before the request is sent, after its body is serialized; every
  other timestamp is `time.perf_counter()` read the moment a chunk of bytes is handed over by the
  socket, before any parsing. An SSE event is stamped with the arrival time of the bytes that
  complete it.
* Only content-bearing events (non-empty `text` / `delta.content`, or a reasoning model's
  `delta.reasoning` / `delta.reasoning_content`), or events that carry `token_ids` (a server's
  `return_token_ids`: tokens whose text is empty, as random weights make, still arrive), count
  as tokens arriving; the role-only first chat chunk and the usage chunk do not.
* Output and prompt token counts come from the server's `usage` (requested with
  `stream_options.include_usage`), never from counting chunks.
* Every request yields a record: HTTP errors, error events, a stream that ends without
  `data: [DONE]`, a missing `usage`, timeouts and connection errors all give `success=False` with
  the reason in `error`. Nothing is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem.bench.datasets import SampleRequest

CHAT_ENDPOINT = "/v1/chat/completions"
ERROR_BODY_LIMIT = 500
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass
class RequestRecord:
    """What the client saw of one request; times are absolute `perf_counter()` seconds."""

    index: int
    start_time: float = 0.0
    end_time: float = 0.0
    content_times: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""
    http_status: int | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def ttft(self) -> float | None:
        return self.content_times[0] - self.start_time if self.content_times else None

    @property
    def ttst(self) -> float | None:
        """Time to second token: arrival of the second content-bearing chunk."""
        return self.content_times[1] - self.start_time if len(self.content_times) > 1 else None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive content-bearing chunks."""
        return [later - earlier for earlier, later in itertools.pairwise(self.content_times)]

    @property
    def e2el(self) -> float:
        return self.end_time - self.start_time

    @property
    def tpot(self) -> float | None:
        """(e2el - ttft) / (output_tokens - 1); None with fewer than two output tokens."""
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - ttft) / (self.output_tokens - 1)


class SseDecoder:
    """Incremental server-sent-events decoder: bytes in, the `data` payload of each event out."""

    def __init__(self) -> None:
        self._pending = b""
        self._data_lines: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        payloads = []
        for raw_line in lines:
            line = raw_line.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data_lines:
                    payloads.append("\n".join(self._data_lines))
                    self._data_lines = []
            elif line.startswith("data:"):
                self._data_lines.append(line[5:].removeprefix(" "))
        return payloads


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    api_url: str
    model: str
    chat: bool
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_body(settings: RequestSettings, sample: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": settings.model}
    if settings.chat:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    body.update(
        max_tokens=sample.expected_output_len,
        temperature=settings.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    if settings.ignore_eos:
        body["ignore_eos"] = True
    body.update(settings.extra_body)
    return body


def content_of(event: dict[str, Any], chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        reasoning = delta.get("reasoning") or delta.get("reasoning_content") or ""  # one text
        return reasoning + (delta.get("content") or "")
    return choices[0].get("text") or ""


class StreamError(Exception):
    """The stream broke the protocol (error event, bad JSON)."""


def apply_event(record: RequestRecord, event: dict[str, Any], chat: bool, arrived: float) -> None:
    if "error" in event:
        raise StreamError(f"error event: {json.dumps(event['error'])[:ERROR_BODY_LIMIT]}")
    text = content_of(event, chat)
    choices = event.get("choices") or []
    token_ids = (choices[0].get("token_ids") if choices else None) or ()
    if text or token_ids:  # ids count even where their text is empty (random weights)
        record.content_times.append(arrived)
        record.generated_text += text
    for choice in event.get("choices") or []:
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        record.output_tokens = int(usage.get("completion_tokens") or 0)


async def send_request(
    session: aiohttp.ClientSession,
    settings: RequestSettings,
    sample: SampleRequest,
    index: int,
) -> RequestRecord:
    """Send one streamed request and record when its bytes arrive; never raises on failure."""
    record = RequestRecord(index=index)
    body = json.dumps(build_body(settings, sample))
    decoder = SseDecoder()
    done = saw_usage = False
    record.start_time = time.perf_counter()
    try:
        async with session.post(settings.api_url, data=body, headers=JSON_HEADERS) as response:
            record.http_status = response.status
            if response.status != 200:
                text = await response.text()
                record.end_time = time.perf_counter()
                record.error = f"HTTP {response.status}: {text[:ERROR_BODY_LIMIT]}"
                return record
            record.end_time = time.perf_counter()
            async for data in response.content.iter_any():
                arrived = time.perf_counter()
                for payload in decoder.feed(data):
                    if payload.strip() == "[DONE]":
                        done = True
                        continue
                    try:
                        event = json.loads(payload)
                    except json.JSONDecodeError as exc:
                        raise StreamError(f"bad JSON in stream: {payload[:200]!r}") from exc
                    if not isinstance(event, dict):
                        raise StreamError(f"stream event is not an object: {payload[:200]!r}")
                    saw_usage = saw_usage or bool(event.get("usage"))
                    apply_event(record, event, settings.chat, arrived)
                record.end_time = arrived
    except (aiohttp.ClientError, asyncio.TimeoutError, StreamError, UnicodeDecodeError) as exc:
        record.end_time = time.perf_counter()
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return record
    if not done:
        record.error = "stream ended without data: [DONE]"
    elif not saw_usage:
        record.error = "no usage in the stream (the server ignored stream_options.include_usage)"
    elif not record.content_times:
        record.error = "the stream carried no content"
    else:
        record.success = True
    return record
