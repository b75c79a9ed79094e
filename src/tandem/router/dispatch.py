"""Sending a leg to a worker: worker choice, retries, reading, lease release, failure answers.

Invariants:
* Nothing is sent to the client before a leg answered, so until then a worker that is down or
  cannot take the request now (connection refused or dropped with no answer, 429, 503) is
  replaced by another one, up to `max_attempts` tries (a dropped connection gets one more try
  on the same worker: it may be an idle pooled connection the worker had closed). Any other
  answer is relayed unchanged with its status: a 4xx is the client's, and a 500 (502, 504) may
  be the request's own doing, which on every worker in turn would fail it (or kill it) again.
* A leg's failure maps to one answer, in one place (`failure_answer` before the first byte,
  `failure_event` after it): no worker 503, worker lost 504, anything else 502.
* A lease release runs in the background (it must outlive a cancelled request) and is logged,
  never raised: a lease not released lasts until its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from tandem.kv.params import KVTransferParams
from tandem.router.classify import PATHS
from tandem.router.config import Role, RouterConfig
from tandem.router.legs import Leg, NoWorker, WorkerLost, send_leg, worker_title
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import Policy
from tandem.router.relay import ResponseHead, error_body, error_event
from tandem.router.workers import Worker, WorkerPool

logger = logging.getLogger("tandem.router")

# Answers that mean "this worker cannot take it now" (queue full, engine dead, draining): the leg
# moves to another worker. Other 5xx are relayed: the request itself may have caused them.
REFUSAL_STATUSES = frozenset({429, 503})
RELEASE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
# What a leg raises when it cannot be answered (WorkerLost is a ClientError); a stream that
# breaks off mid-event may raise ValueError too
LEG_FAILURES = (NoWorker, aiohttp.ClientError)
STREAM_FAILURES = (*LEG_FAILURES, ValueError)


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
    # the prompt's chained block hashes (policies.prefix_hashes), once something needed them
    prompt_hashes: list[int] | None = None
    # the prompt tokens (estimated) the chosen decode worker holds, and those the worker that
    # prefills the request computes, where the router decided the flow (conditional
    # disaggregation); 0 otherwise
    decode_cached_tokens: int = 0
    prefill_tokens: int = 0


@contextmanager
def waiting_on_workers(ctx: RequestContext) -> Iterator[None]:
    """Counts the block's time as time spent waiting on workers (not the router's own)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        ctx.upstream_wait_s += time.perf_counter() - started


def refusal(
    ctx: RequestContext, status: int, message: str, code: str, outcome: str
) -> tuple[ResponseHead, bytes]:
    """An error answer, before the first byte."""
    ctx.outcome = outcome
    error_type = "invalid_request_error" if status < 500 else "server_error"
    return ResponseHead(status, "application/json"), error_body(message, error_type, code)


def failure_answer(ctx: RequestContext, exc: Exception, what: str) -> tuple[ResponseHead, bytes]:
    """The answer for a leg that failed with `exc` before the first byte; `what` names the
    worker that failed (\"the prefill worker\")."""
    if isinstance(exc, NoWorker):
        return refusal(ctx, 503, str(exc), "no_worker", "no_worker")
    if isinstance(exc, WorkerLost):
        return refusal(ctx, 504, str(exc), "worker_lost", "upstream_error")
    return refusal(ctx, 502, f"{what} failed: {exc!r}", "upstream_error", "upstream_error")


def failure_event(ctx: RequestContext, exc: Exception, leg: Leg | None) -> bytes:
    """The events that end a stream whose `leg` (None: still opening) failed with `exc`."""
    ctx.outcome = "no_worker" if isinstance(exc, NoWorker) else "upstream_error"
    failure = exc if leg is None else leg.failure(exc)
    if isinstance(failure, NoWorker):
        return error_event(str(failure), "no_worker")
    if isinstance(failure, WorkerLost):
        return error_event(str(failure), "worker_lost")
    if leg is None:
        return error_event(f"the decode leg failed: {exc!r}", "upstream")
    message = f"{worker_title(leg.name, leg.worker)} failed mid-stream: {exc!r}"
    return error_event(message, "upstream")


def relayed(ctx: RequestContext, leg: Leg, data: bytes) -> tuple[ResponseHead, bytes]:
    """A worker's answer passed on with its status and content type."""
    status = leg.response.status
    if status >= 400:
        ctx.outcome = "client_error" if status < 500 else "upstream_error"
    media_type = leg.response.headers.get("content-type", "application/json")
    return ResponseHead(status, media_type), data


class Dispatcher:
    """The router's calls to its workers, over one HTTP session."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
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

    async def open_leg(
        self,
        ctx: RequestContext,
        leg_name: str,
        roles: tuple[Role, ...],
        policy: Policy,
        body: dict[str, Any],
        prefix: Sequence[int] = (),
        accept: Callable[[Worker], bool] | None = None,
        prompt_tokens: int = 0,
    ) -> Leg:
        """Sends `body` to a worker of `roles` (those `accept` takes, if given), moving on to
        another one while workers refuse. Returns once a worker answered with a status that is
        not a refusal (its body unread); NoWorker when none did. `prompt_tokens`: those the
        worker computes for this leg, counted on it until the leg's first byte (`Leg`)."""
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
            self.pool.begin(worker, prompt_tokens)
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
                self.pool.finish(worker, prompt_tokens)
                self.pool.mark_down(worker, str(exc) or exc.__class__.__name__)
                failures.append(f"{worker.url} is unreachable")
            except WorkerLost:
                self.pool.finish(worker, prompt_tokens)
                raise
            except aiohttp.ClientConnectionError as exc:
                self.pool.finish(worker, prompt_tokens)
                failures.append(f"{worker.url} dropped the connection ({exc.__class__.__name__})")
                if worker.url not in dropped:  # maybe an idle pooled connection it had closed:
                    dropped.add(worker.url)  # the same worker gets one more try
                    tried.remove(worker.url)
            except BaseException:
                self.pool.finish(worker, prompt_tokens)
                raise
            else:
                if response.status not in REFUSAL_STATUSES:
                    return Leg(self.pool, worker, response, leg_name, prompt_tokens)
                try:
                    detail = (await response.text())[:200]
                except (aiohttp.ClientError, UnicodeDecodeError):
                    detail = ""
                finally:
                    response.close()
                    self.pool.finish(worker, prompt_tokens)
                failures.append(f"{worker.url} answered {response.status} {detail}".rstrip())
            self.metrics.refusals.labels(leg_name).inc()
        pool_name = " or ".join(roles)
        if not failures:
            raise NoWorker(f"no {pool_name} worker is available")
        raise NoWorker(f"no {pool_name} worker could take the request: " + "; ".join(failures))

    @staticmethod
    async def read_leg(leg: Leg) -> bytes:
        """The whole body of a leg (WorkerLost if its worker is lost meanwhile); the leg is
        closed after."""
        try:
            return await leg.response.read()
        except aiohttp.ClientError as exc:
            raise leg.failure(exc) from exc
        finally:
            leg.close()

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

    def release(self, worker: Worker, lease: KVTransferParams) -> None:
        """Frees a prefill lease in the background (it must outlive a cancelled request)."""
        request_id = lease.remote_request_id
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
