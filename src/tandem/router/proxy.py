"""One client request's trip through the workers: the two PD legs, or one plain leg.

Disaggregated (a prefill and a decode worker in the pool, one prompt, n == 1):

    client ──▶ router ──(1) prefill leg: stream=false, max_tokens=1, kv_transfer_params──▶ prefill
                  │◀── first token text + kv_transfer_params ──────────────────────────────┘
                  ├──▶ client: head + first token            (TTFT does not include the transfer)
                  └──(2) decode leg: client body + kv_transfer_params ──▶ decode ──▶ relayed to
                         the client with the first len(first_text) characters skipped

Handoff (streamed, and tandem workers on both sides): the decode leg goes out together with the
prefill leg, carrying a handoff id; the decode worker waits on the prefill worker's KV server
for the prefill's announcement instead of for the router (docs/protocol.md). The client sees the
same stream.

Plain (n > 1, batch prompts, prompt logprobs, max_tokens 0, tool calls, or no prefill/decode
pair): the body goes unchanged to a decode or `both` worker and its answer is relayed.

Invariants:
* Nothing is sent to the client before the first leg answered, so until then a worker that is
  down or cannot take the request now (connection refused or dropped with no answer, 429, 503)
  is replaced by another one, up to `max_attempts` tries (a dropped connection gets one more try
  on the same worker: it may be an idle pooled connection the worker had closed). Any other
  answer is relayed unchanged with its status: a 4xx is the client's, and a 500 (502, 504) may
  be the request's own doing, which on every worker in turn would fail it (or kill it) again.
  The decode leg is also retried on another decode worker while none of its bytes reached the
  client (the prefill lease still holds the KV).
* After the first byte, a failure ends the stream with an error event and `data: [DONE]`.
* No leg has a read timeout (legs.py): a leg ends early only when its worker is lost (its
  health checks went unanswered for `read_timeout_s`, or its heartbeats stopped): 504
  `worker_lost` before the first byte, an error event after.
* The prefill lease is released (`POST /v1/kv/release`) whenever the decode leg never answered
  200 or failed mid-stream; a client that leaves mid-decode is left to the decode worker, which
  sees its connection close.
* Every worker counted in flight by `WorkerPool.begin` is finished exactly once (`Leg.close`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from tandem.router.config import Role, RouterConfig
from tandem.router.legs import (
    Leg,
    NoWorker,
    WorkerLost,
    give_up,
    send_leg,
    worker_title,
)
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import (
    PinnedPolicy,
    Policy,
    make_policy,
    prefix_hashes,
    prompt_units,
)
from tandem.router.relay import (
    JSON_HEAD,
    SSE_HEAD,
    ResponseHead,
    error_body,
    error_event,
    iter_sse_data,
    sse_event,
)
from tandem.router.workers import Worker, WorkerPool

logger = logging.getLogger("tandem.router")

Flow = AsyncGenerator[ResponseHead | bytes, None]

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Answers that mean "this worker cannot take it now" (queue full, engine dead, draining): the leg
# moves to another worker. Other 5xx are relayed: the request itself may have caused them.
REFUSAL_STATUSES = frozenset({429, 503})
PREFILL_KV_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
RELEASE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


@dataclass
class PrefillAnswer:
    """A prefill leg's answer (status 200), parsed."""

    worker: Worker
    answer: dict[str, Any]
    first_text: str
    kv_transfer_params: dict[str, Any] | None


@dataclass
class RequestContext:
    endpoint: str  # "completions" | "chat"
    body: dict[str, Any]
    request_id: str
    stream: bool
    started: float = field(default_factory=time.perf_counter)
    upstream_wait_s: float = 0.0
    status: int = 0
    first_byte_at: float | None = None
    outcome: str = "success"


@contextmanager
def waiting_on_workers(ctx: RequestContext) -> Iterator[None]:
    """Counts the block's time as time spent waiting on workers (not the router's own)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        ctx.upstream_wait_s += time.perf_counter() - started


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    if body.get("min_tokens"):  # the first token may not end the request either
        leg["min_tokens"] = 1
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    leg["kv_transfer_params"] = dict(PREFILL_KV_REQUEST)
    return leg


def wants_one_token(endpoint: str, body: dict[str, Any]) -> bool:
    limit = body.get("max_tokens")
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        limit = body["max_completion_tokens"]
    return limit == 1


def is_single_prompt(endpoint: str, body: dict[str, Any]) -> bool:
    """True unless the request asks for several choices or holds a batch of prompts."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if endpoint == "chat":
        return True
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt) == 1
    return True


def needs_one_worker(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether one worker must answer the request whole: it wants its prompt's logprobs
    (vLLM's prompt_logprobs, or echo with logprobs; only the worker that computes the prompt
    has them), no token at all (max_tokens 0: echo scores the prompt only), or tool calls
    (made of the whole output, where the PD flow streams the first token's text)."""
    if body.get("prompt_logprobs") is not None or body.get("max_tokens") == 0:
        return True
    if endpoint == "chat":
        return bool(body.get("tools")) and body.get("tool_choice") != "none"
    return bool(body.get("echo")) and body.get("logprobs") is not None


def stop_hold_back(body: dict[str, Any]) -> int:
    """How many characters of an unfinished output a worker's stream keeps back, as they may
    begin one of the request's stop strings (the longest one's length - 1; none when the stop
    string stays in the output)."""
    stop = body.get("stop") or []
    if body.get("include_stop_str_in_output"):
        return 0
    return max((len(s) for s in ([stop] if isinstance(stop, str) else stop)), default=1) - 1


def choice_text(endpoint: str, choice: dict[str, Any], *, streamed: bool) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    holder = choice.get("delta" if streamed else "message") or {}
    return holder.get("content") or ""


class Proxy:
    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.prefill_policy: Policy = make_policy(
            config.prefill_policy, config.prefix_balance_threshold
        )
        self.decode_policy: Policy = make_policy(
            config.decode_policy, config.prefix_balance_threshold
        )
        # a leg waits as long as its worker lives; a tokenizer call is short
        self._leg_timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
        self._call_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Proxy.start() was not called"
        return self._session

    async def start(self) -> None:
        # Idle upstream connections are dropped before a worker's keep-alive timeout (uvicorn:
        # 5 s) can close them under a request.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
        bearer = self.config.worker_bearer  # every call to a worker, health checks included
        headers = {"authorization": f"Bearer {bearer}"} if bearer else {}
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, headers=headers
        )

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    # ---- entry --------------------------------------------------------------------------------

    def handle(self, endpoint: str, body: dict[str, Any]) -> Flow:
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        ctx = RequestContext(
            endpoint=endpoint,
            body=body,
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            stream=bool(body.get("stream")),
        )
        return self._observed(ctx, self._route(ctx))

    async def _observed(self, ctx: RequestContext, flow: Flow) -> Flow:
        """Relays `flow` and records the request's metrics when it ends, however it ends."""
        try:
            async for item in flow:
                if isinstance(item, ResponseHead):
                    ctx.status = item.status
                elif ctx.first_byte_at is None:
                    now = time.perf_counter()
                    ctx.first_byte_at = now
                    self.metrics.added.observe(max(0.0, now - ctx.started - ctx.upstream_wait_s))
                    if ctx.stream and ctx.status == 200:
                        self.metrics.ttft.labels(ctx.endpoint).observe(now - ctx.started)
                        model_name = self._model_name(ctx)
                        self.metrics.vllm_ttft.labels(model_name).observe(now - ctx.started)
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            ctx.outcome = "aborted"
            raise
        finally:
            await flow.aclose()
            elapsed = time.perf_counter() - ctx.started
            self.metrics.requests.labels(ctx.endpoint, ctx.outcome).inc()
            self.metrics.e2e.labels(ctx.endpoint).observe(elapsed)
            if ctx.outcome == "success":  # the model name is one the workers serve
                model_name = self._model_name(ctx)
                self.metrics.vllm_e2e.labels(model_name).observe(elapsed)
                self.metrics.vllm_success.labels(model_name).inc()

    def _model_name(self, ctx: RequestContext) -> str:
        """The request's model, else the workers' (vLLM's label `model_name`)."""
        model = ctx.body.get("model")
        if isinstance(model, str):
            return model
        served = self.pool.models()
        return served[0] if served else ""

    async def _route(self, ctx: RequestContext) -> Flow:
        disaggregate = (
            is_single_prompt(ctx.endpoint, ctx.body)
            and not needs_one_worker(ctx.endpoint, ctx.body)
            and self.pool.available(("prefill",))
            and self.pool.available(("decode",))
        )
        flow = self._disaggregated(ctx) if disaggregate else self._plain(ctx)
        try:
            async for item in flow:
                yield item
        finally:
            await flow.aclose()

    # ---- upstream calls -------------------------------------------------------------------------

    async def _open_leg(
        self,
        ctx: RequestContext,
        leg_name: str,
        roles: tuple[Role, ...],
        policy: Policy,
        body: dict[str, Any],
        prefix: Sequence[int] = (),
        accept: Callable[[Worker], bool] | None = None,
    ) -> Leg:
        """Sends `body` to a worker of `roles` (those `accept` takes, if given), moving on to
        another one while workers refuse.

        Returns once a worker answered with a status that is not a refusal (its body unread).
        """
        payload = msgspec.json.encode(body)
        headers = {"content-type": "application/json", "x-request-id": ctx.request_id}
        tried: list[str] = []
        failures: list[str] = []
        dropped: set[str] = set()
        for _ in range(self.config.max_attempts):
            candidates = self.pool.available(roles, exclude=tried)
            if accept is not None:
                candidates = [worker for worker in candidates if accept(worker)]
            if not candidates:
                break
            worker = policy.choose(candidates, prefix)
            tried.append(worker.url)
            self.pool.begin(worker)
            try:
                response = await send_leg(
                    self.session,
                    worker,
                    leg_name,
                    PATHS[ctx.endpoint],
                    payload,
                    headers,
                    self._leg_timeout,
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                self.pool.finish(worker)
                self.pool.mark_down(worker, str(exc) or exc.__class__.__name__)
                failures.append(f"{worker.url} is unreachable")
            except WorkerLost:
                self.pool.finish(worker)
                raise
            except aiohttp.ClientConnectionError as exc:
                self.pool.finish(worker)
                failures.append(f"{worker.url} dropped the connection ({exc.__class__.__name__})")
                if worker.url not in dropped:  # maybe an idle pooled connection it had closed:
                    dropped.add(worker.url)  # the same worker gets one more try
                    tried.remove(worker.url)
            except BaseException:
                self.pool.finish(worker)
                raise
            else:
                if response.status not in REFUSAL_STATUSES:
                    return Leg(self.pool, worker, response, leg_name)
                try:
                    detail = (await response.text())[:200]
                except (aiohttp.ClientError, UnicodeDecodeError):
                    detail = ""
                finally:
                    response.close()
                    self.pool.finish(worker)
                failures.append(f"{worker.url} answered {response.status} {detail}".rstrip())
            self.metrics.refusals.labels(leg_name).inc()
        pool_name = " or ".join(roles)
        if not failures:
            raise NoWorker(f"no {pool_name} worker is available")
        raise NoWorker(f"no {pool_name} worker could take the request: " + "; ".join(failures))

    async def forward(self, path: str, payload: bytes) -> tuple[int, str, bytes]:
        """A request any worker answers alike (`/tokenize`, `/detokenize`): sent to the
        available workers in turn until one takes it; its status, content type and body."""
        failures = []
        headers = {"content-type": "application/json"}
        for worker in self.pool.available(("both", "decode", "prefill")):
            try:
                async with self.session.post(
                    worker.url + path, data=payload, headers=headers, timeout=self._call_timeout
                ) as response:
                    data = await response.read()
                    if response.status not in REFUSAL_STATUSES:
                        media_type = response.headers.get("content-type", "application/json")
                        return response.status, media_type, data
                    failures.append(f"{worker.url} answered {response.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failures.append(f"{worker.url} failed ({exc.__class__.__name__})")
        message = "no worker could take the request" + (
            ": " + "; ".join(failures) if failures else ""
        )
        return 503, "application/json", error_body(message, "server_error", "no_worker")

    @staticmethod
    async def _read_leg(leg: Leg) -> bytes:
        """The whole body of a leg (WorkerLost if its worker is lost meanwhile); the leg is
        closed after."""
        try:
            return await leg.response.read()
        except aiohttp.ClientError as exc:
            raise leg.failure(exc) from exc
        finally:
            leg.close()

    def _release(self, worker: Worker, kv_transfer_params: dict[str, Any]) -> None:
        """Frees a prefill lease in the background (it must outlive a cancelled request)."""
        request_id = kv_transfer_params.get("remote_request_id")
        if request_id is None:
            return
        self.metrics.kv_releases.inc()

        async def release() -> None:
            try:
                async with self.session.post(
                    worker.url + "/v1/kv/release",
                    json={"remote_request_id": request_id},
                    timeout=RELEASE_TIMEOUT,
                ) as response:
                    answer = await response.read()
                    if response.status != 200:  # the lease lasts until its timeout
                        logger.warning(
                            "releasing %s on %s was refused (%d): %s",
                            request_id, worker.url, response.status, answer[:200],
                        )  # fmt: skip
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                logger.warning("releasing %s on %s failed: %r", request_id, worker.url, exc)

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- answers that end a request before its first byte --------------------------------------

    @staticmethod
    def _refusal(
        ctx: RequestContext, status: int, message: str, code: str, outcome: str
    ) -> tuple[ResponseHead, bytes]:
        ctx.outcome = outcome
        error_type = "invalid_request_error" if status < 500 else "server_error"
        return ResponseHead(status, "application/json"), error_body(message, error_type, code)

    @staticmethod
    def _relayed(ctx: RequestContext, leg: Leg, data: bytes) -> tuple[ResponseHead, bytes]:
        """A worker's answer passed on with its status and content type."""
        status = leg.response.status
        if status >= 400:
            ctx.outcome = "client_error" if status < 500 else "upstream_error"
        media_type = leg.response.headers.get("content-type", "application/json")
        return ResponseHead(status, media_type), data

    # ---- plain: one leg -------------------------------------------------------------------------

    async def _plain(self, ctx: RequestContext) -> Flow:
        try:
            with waiting_on_workers(ctx):
                leg = await self._open_leg(
                    ctx, "plain", ("decode", "both"), self.decode_policy, ctx.body
                )
        except NoWorker as exc:
            for item in self._refusal(ctx, 503, str(exc), "no_worker", "no_worker"):
                yield item
            return
        except WorkerLost as exc:
            for item in self._refusal(ctx, 504, str(exc), "worker_lost", "upstream_error"):
                yield item
            return

        if leg.response.status != 200 or not ctx.stream:
            try:
                with waiting_on_workers(ctx):
                    data = await self._read_leg(leg)
            except WorkerLost as exc:
                for item in self._refusal(ctx, 504, str(exc), "worker_lost", "upstream_error"):
                    yield item
                return
            except aiohttp.ClientError as exc:
                message = f"the worker {leg.worker.url} failed: {exc!r}"
                for item in self._refusal(ctx, 502, message, "upstream_error", "upstream_error"):
                    yield item
                return
            for item in self._relayed(ctx, leg, data):
                yield item
            return

        try:
            yield SSE_HEAD
            finished = False
            async for payload in iter_sse_data(leg.response.content.iter_any()):
                if finished:
                    continue  # drained to the end, so the connection can be reused
                yield b"data: " + payload + b"\n\n"
                finished = payload == b"[DONE]"
            if not finished:
                raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
        except aiohttp.ClientError as exc:
            ctx.outcome = "upstream_error"
            yield self._mid_stream_error(leg, exc)
        finally:
            leg.close()

    @staticmethod
    def _mid_stream_error(leg: Leg, exc: BaseException) -> bytes:
        """The events that end a stream whose leg failed after its first byte."""
        failure = leg.failure(exc)
        if isinstance(failure, WorkerLost):
            return error_event(str(failure), "worker_lost")
        message = f"{worker_title(leg.name, leg.worker)} failed mid-stream: {exc!r}"
        return error_event(message, "upstream")

    # ---- disaggregated: prefill leg, then decode leg --------------------------------------------

    def _prefill_prefix(self, ctx: RequestContext) -> list[int]:
        """The prompt's block hashes for the prefill policy; none when it has no choice to make
        (one prefill worker): hashing a long prompt costs the prefill leg hundreds of µs."""
        if not self.prefill_policy.uses_prefix or len(self.pool.available(("prefill",))) < 2:
            return []
        units = prompt_units(ctx.endpoint, ctx.body)
        return prefix_hashes(units, self.config.prefix_block_chars, ctx.body.get("cache_salt"))

    async def _disaggregated(self, ctx: RequestContext) -> Flow:
        prefix = self._prefill_prefix(ctx)
        handoff_to = self._handoff_worker(ctx, prefix)
        flow = (
            self._handed_off(ctx, handoff_to, prefix)
            if handoff_to is not None
            else self._in_sequence(ctx, prefix)
        )
        try:
            async for item in flow:
                yield item
        finally:
            await flow.aclose()

    async def _prefill(
        self,
        ctx: RequestContext,
        body: dict[str, Any],
        prefix: Sequence[int],
        pinned: Worker | None = None,
    ) -> PrefillAnswer | tuple[ResponseHead, bytes]:
        """Runs the prefill leg: its parsed answer, or what to answer the client instead. With
        a `pinned` worker (chosen already), only that one is tried, and NoWorker is raised
        rather than answered."""
        try:
            with waiting_on_workers(ctx):
                prefill = await self._open_leg(
                    ctx,
                    "prefill",
                    ("prefill",),
                    self.prefill_policy if pinned is None else PinnedPolicy(),
                    body,
                    prefix,
                    None if pinned is None else (lambda worker: worker is pinned),
                )
                data = await self._read_leg(prefill)
        except NoWorker as exc:
            if pinned is not None:
                raise
            return self._refusal(ctx, 503, str(exc), "no_worker", "no_worker")
        except WorkerLost as exc:
            return self._refusal(ctx, 504, str(exc), "worker_lost", "upstream_error")
        except aiohttp.ClientError as exc:
            message = f"the prefill worker failed: {exc!r}"
            return self._refusal(ctx, 502, message, "upstream_error", "upstream_error")

        if prefill.response.status != 200:
            return self._relayed(ctx, prefill, data)
        try:
            answer = msgspec.json.decode(data)
            first_choice = answer["choices"][0]
            kv_transfer_params = answer.get("kv_transfer_params")
        except (ValueError, KeyError, IndexError, TypeError):
            message = f"the prefill worker {prefill.worker.url} sent a malformed answer"
            return self._refusal(ctx, 502, message, "upstream_error", "upstream_error")
        first_text = choice_text(ctx.endpoint, first_choice, streamed=False)
        return PrefillAnswer(prefill.worker, answer, first_text, kv_transfer_params)

    def _prefill_alone(self, ctx: RequestContext, prefill: PrefillAnswer) -> Iterator[Any]:
        """The answer when the prefill leg is the whole request (one token, or done on it)."""
        if prefill.kv_transfer_params is not None:
            self._release(prefill.worker, prefill.kv_transfer_params)
        answer = prefill.answer
        answer.pop("kv_transfer_params", None)
        if ctx.stream:
            yield SSE_HEAD
            yield from self._prefill_only_chunks(ctx, answer, prefill.first_text)
        else:
            yield JSON_HEAD
            yield msgspec.json.encode(answer)

    async def _in_sequence(self, ctx: RequestContext, prefix: Sequence[int]) -> Flow:
        """vLLM's flow: the prefill leg, then the decode leg with its kv_transfer_params."""
        prefill = await self._prefill(ctx, prefill_leg_body(ctx.body), prefix)
        if not isinstance(prefill, PrefillAnswer):
            for item in prefill:
                yield item
            return
        if prefill.kv_transfer_params is None or wants_one_token(ctx.endpoint, ctx.body):
            for item in self._prefill_alone(ctx, prefill):
                yield item
            return

        decode_body = dict(ctx.body, kv_transfer_params=prefill.kv_transfer_params)
        if ctx.stream:
            # The decode leg starts before the first token is sent, so the transfer overlaps it.
            opening = asyncio.ensure_future(self._open_decode_leg(ctx, decode_body))
            flow = self._decode_streamed(ctx, prefill, opening)
        else:
            flow = self._decode_whole(ctx, prefill.worker, decode_body)
        try:
            async for item in flow:
                yield item
        finally:
            await flow.aclose()

    def _handoff_worker(self, ctx: RequestContext, prefix: Sequence[int]) -> Worker | None:
        """The prefill worker to hand a streamed request off from, or None for vLLM's flow:
        handoffs need prefill workers and decode workers that take them over one transport."""
        if not (self.config.handoff and ctx.stream) or wants_one_token(ctx.endpoint, ctx.body):
            return None
        # Every prefill worker must qualify: the policy chooses once, for whichever flow runs.
        prefills, decoders = self.pool.available(("prefill",)), self.pool.available(("decode",))
        if not all(
            worker.takes_handoffs and any(_can_wait_on(decoder, worker) for decoder in decoders)
            for worker in prefills
        ):
            return None
        return self.prefill_policy.choose(prefills, prefix)

    async def _handed_off(
        self, ctx: RequestContext, prefill_worker: Worker, prefix: Sequence[int]
    ) -> Flow:
        """tandem's own flow: the decode leg goes out with the prefill leg and waits on the
        prefill worker's KV server for the handoff; the decode worker has its blocks ready and
        loads the KV as soon as the prefill announces it, while the first token travels back
        through this router. If the chosen prefill worker refuses, vLLM's flow takes over."""
        self.metrics.handoffs.inc()
        handoff_id = uuid.uuid4().hex
        endpoint = prefill_worker.kv_endpoint or {}
        prefill_body = prefill_leg_body(ctx.body)
        prefill_body["kv_transfer_params"]["handoff_id"] = handoff_id
        decode_body = dict(
            ctx.body,
            kv_transfer_params={
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "handoff_id": handoff_id,
                "remote_host": endpoint.get("host"),
                "remote_port": endpoint.get("port"),
                "kv_transport": endpoint.get("transport"),
            },
        )
        opening = asyncio.ensure_future(
            self._open_decode_leg(
                ctx, decode_body, accept=lambda worker: _can_wait_on(worker, prefill_worker)
            )
        )
        flow: Flow | None = None
        try:
            try:
                prefill = await self._prefill(ctx, prefill_body, prefix, pinned=prefill_worker)
            except NoWorker:
                give_up(opening)
                flow = self._in_sequence(ctx, prefix)
            else:
                if not isinstance(prefill, PrefillAnswer):
                    give_up(opening)
                    for item in prefill:
                        yield item
                    return
                if prefill.kv_transfer_params is None:
                    give_up(opening)
                    for item in self._prefill_alone(ctx, prefill):
                        yield item
                    return
                flow = self._decode_streamed(ctx, prefill, opening)
            async for item in flow:
                yield item
        finally:
            if flow is not None:
                await flow.aclose()
            give_up(opening)

    def _open_decode_leg(
        self,
        ctx: RequestContext,
        decode_body: dict[str, Any],
        accept: Callable[[Worker], bool] | None = None,
    ) -> Any:
        return self._open_leg(
            ctx, "decode", ("decode",), self.decode_policy, decode_body, accept=accept
        )

    async def _decode_whole(
        self, ctx: RequestContext, prefill_worker: Worker, decode_body: dict[str, Any]
    ) -> Flow:
        kv_transfer_params = decode_body["kv_transfer_params"]
        completed = False
        try:
            with waiting_on_workers(ctx):
                leg = await self._open_decode_leg(ctx, decode_body)
                data = await self._read_leg(leg)
        except NoWorker as exc:
            for item in self._refusal(ctx, 503, str(exc), "no_worker", "no_worker"):
                yield item
        except WorkerLost as exc:
            for item in self._refusal(ctx, 504, str(exc), "worker_lost", "upstream_error"):
                yield item
        except aiohttp.ClientError as exc:
            message = f"the decode worker failed: {exc!r}"
            for item in self._refusal(ctx, 502, message, "upstream_error", "upstream_error"):
                yield item
        else:
            completed = leg.response.status == 200
            for item in self._relayed(ctx, leg, data):
                yield item
        finally:
            if not completed:
                self._release(prefill_worker, kv_transfer_params)

    def _prefill_only_chunks(
        self, ctx: RequestContext, answer: dict[str, Any], first_text: str
    ) -> list[bytes]:
        """A whole streamed answer made from the prefill leg's answer alone."""
        choice = answer["choices"][0]
        chunks = [
            self._first_chunk(ctx, answer, first_text),
            sse_event(self._chunk(ctx, answer, "", choice.get("finish_reason"), delta={})),
        ]
        if (ctx.body.get("stream_options") or {}).get("include_usage"):
            usage_chunk = self._chunk(ctx, answer, "", None, delta={})
            usage_chunk["choices"] = []
            usage_chunk["usage"] = answer.get("usage")
            chunks.append(sse_event(usage_chunk))
        chunks.append(b"data: [DONE]\n\n")
        return chunks

    def _chunk(
        self,
        ctx: RequestContext,
        answer: dict[str, Any],
        text: str,
        finish_reason: str | None,
        *,
        delta: dict[str, Any],
    ) -> dict[str, Any]:
        if ctx.endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
            object_name = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            object_name = "text_completion"
        choice["finish_reason"] = finish_reason
        return {
            "id": ctx.request_id,
            "object": object_name,
            "created": answer.get("created", int(time.time())),
            "model": answer.get("model"),
            "choices": [choice],
        }

    def _first_chunk(self, ctx: RequestContext, answer: dict[str, Any], first_text: str) -> bytes:
        chunk = self._chunk(
            ctx, answer, first_text, None, delta={"role": "assistant", "content": first_text}
        )
        chunk["choices"][0]["logprobs"] = answer["choices"][0].get("logprobs")
        if "token_ids" in answer["choices"][0]:  # the client asked for return_token_ids
            chunk["choices"][0]["token_ids"] = answer["choices"][0]["token_ids"]
        return sse_event(chunk)

    async def _decode_streamed(
        self, ctx: RequestContext, prefill: PrefillAnswer, opening: asyncio.Future[Leg]
    ) -> Flow:
        """The first token from the prefill answer, then the decode leg `opening` relayed. The
        first token's text goes out as a worker streams it: less what may begin a stop string
        (the decode leg, which completes or rules out that string, sends the rest). A decode
        leg that has refused the request by then (a handoff's, opened with the prefill leg)
        has its refusal relayed instead, status and all."""
        first_text = prefill.first_text
        first_text = first_text[: max(0, len(first_text) - stop_hold_back(ctx.body))]
        leg: Leg | None = None
        completed = False
        try:
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                leg = opening.result()
                if leg.response.status != 200:
                    # Refused already (a field the prefill leg does not carry, as max_tokens):
                    # its answer goes to the client as it is, nothing streamed yet.
                    for item in self._relayed(ctx, leg, await self._read_leg(leg)):
                        yield item
                    return
            yield SSE_HEAD
            yield self._first_chunk(ctx, prefill.answer, first_text)
            try:
                leg = await opening
            except NoWorker as exc:
                ctx.outcome = "no_worker"
                yield error_event(str(exc), "no_worker")
                return
            except WorkerLost as exc:
                ctx.outcome = "upstream_error"
                yield error_event(str(exc), "worker_lost")
                return
            if leg.response.status != 200:
                yield await self._decode_refusal_event(ctx, leg)
                return
            async for event in self._relay_decode(ctx, leg, len(first_text)):
                yield event
            completed = True
        except (aiohttp.ClientError, ValueError) as exc:
            ctx.outcome = "upstream_error"
            if leg is None:
                yield error_event(f"the decode leg failed: {exc!r}", "upstream")
            else:
                yield self._mid_stream_error(leg, exc)
        except (GeneratorExit, asyncio.CancelledError):
            completed = leg is not None  # the client left mid-decode: the decode worker aborts
            raise
        finally:
            give_up(opening)
            if leg is not None:
                leg.close()
            if not completed:
                self._release(prefill.worker, prefill.kv_transfer_params)

    async def _decode_refusal_event(self, ctx: RequestContext, leg: Leg) -> bytes:
        status = leg.response.status
        ctx.outcome = "client_error" if status < 500 else "upstream_error"
        try:
            detail = (await self._read_leg(leg)).decode(errors="replace")
            message = msgspec.json.decode(detail)["error"]["message"]
        except (aiohttp.ClientError, ValueError, KeyError, TypeError):
            message = f"the decode worker {leg.worker.url} answered {status}"
        return error_event(message, str(status))

    async def _relay_decode(self, ctx: RequestContext, leg: Leg, skip: int) -> Flow:
        """The decode stream as client events: our id, and the first `skip` characters, the
        first token id and its logprobs (all already sent from the prefill answer) cut."""
        text_key = "text" if ctx.endpoint == "completions" else "content"
        skip_ids = skip_logprobs = 1
        async for payload in iter_sse_data(leg.response.content.iter_any()):
            if payload == b"[DONE]":
                yield b"data: [DONE]\n\n"
                await leg.response.read()  # drained to the end, so the connection can be reused
                return
            chunk = msgspec.json.decode(payload)
            if "error" in chunk:
                ctx.outcome = "upstream_error"
                yield b"data: " + payload + b"\n\n"
                continue
            chunk["id"] = ctx.request_id
            choices = chunk.get("choices") or []
            for choice in choices:
                holder = choice if ctx.endpoint == "completions" else (choice.get("delta") or {})
                holder.pop("role", None)
                if skip_ids and choice.get("token_ids"):
                    choice["token_ids"] = choice["token_ids"][skip_ids:]
                    skip_ids = 0
                if skip_logprobs and choice.get("logprobs"):
                    choice["logprobs"] = _without_first_logprob(choice["logprobs"])
                    skip_logprobs = 0
                if skip and holder.get(text_key):
                    text = holder[text_key]
                    cut = min(skip, len(text))
                    holder[text_key] = text[cut:]
                    skip -= cut
            if (
                choices
                and not chunk.get("usage")
                and all(_is_empty(c, ctx.endpoint) for c in choices)
            ):
                continue
            yield sse_event(chunk)
        raise aiohttp.ClientPayloadError("the decode stream ended without [DONE]")


def _without_first_logprob(logprobs: dict[str, Any]) -> dict[str, Any] | None:
    """A chunk's logprobs less the first token's entry (chat: `content`; completions: the
    parallel lists); None once none is left."""
    lists = {key: value[1:] for key, value in logprobs.items() if isinstance(value, list)}
    if not any(lists.values()):
        return None
    return dict(logprobs, **lists)


def _is_empty(choice: dict[str, Any], endpoint: str) -> bool:
    """True for a chunk choice that carries nothing for the client (its text was cut)."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") or choice.get("token_ids"):
        return False
    if endpoint == "completions":
        return not choice.get("text")
    return not any((choice.get("delta") or {}).values())


def _can_wait_on(decode_worker: Worker, prefill_worker: Worker) -> bool:
    """Whether the decode worker takes handoffs over the prefill worker's KV transport."""
    transport = (prefill_worker.kv_endpoint or {}).get("transport")
    return (
        decode_worker.takes_handoffs
        and (decode_worker.kv_endpoint or {}).get("transport") == transport
    )
