"""The pool of workers the router knows, and which of them may take requests now (docs/router.md,
"Discovery and health" and "Failures").

A worker is known either statically (a command-line URL; it stays known for the router's life) or
by registration (`POST /internal/workers/register`; it is forgotten when its heartbeats stop for
`heartbeat_timeout_s`, or when it deregisters). A known worker is *in the pool* while it is
healthy: `health_failures` failed `GET /health` checks in a row (one every `health_interval_s`)
or a connection refused or reset while proxying take it out, one passing check brings it back;
a registered worker whose last heartbeat is older than `heartbeat_timeout_s` is out.

Out of the pool is not *lost*. Requests in flight on a worker are never cut for taking long;
they are given up only when the worker is lost: out of the pool with its health checks
unanswered (timed out, not refused) for `read_timeout_s`, or, registered, forgotten for its
missing heartbeats. `Worker.when_lost()` is resolved then, with the reason, and the legs waiting
on it end. A refused check does not count: a worker that closed its port is draining (its open
connections still answer) or dead (they break on their own).

Every worker enters the pool only through a passing health check (one round before the router
serves; a registering worker, or one out of the pool that sends a heartbeat, is checked at
once): registration is discovery, never a claim of health. A tandem worker's health answer
carries its load (`WorkerLoad`), and an `auto` worker's duty (`assigned`) is the planner's, set
after each health round (planner.py). All state is touched from the router's event loop only."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem.router.config import ROLES, Role, RouterConfig, normalize_url
from tandem.router.metrics import RouterMetrics
from tandem.router.planner import Planner

logger = logging.getLogger("tandem.router")


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load report (the `load` object of its /health answer)."""

    requests_running: int = 0
    requests_waiting: int = 0
    tokens_waiting: int = 0  # prompt tokens admitted and not yet computed (its prefill queue)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tpot_p90_ms: int = 0  # 90th percentile of its streams' time per output token (recent, live)
    idle_ms: int = 0  # how long it has had no request in flight (0: it has one)
    # what its decoding costs (engine/step_costs.py; 0: not known yet): its decode step's line
    # against the context it reads, and the mean context and time per token of its decode
    # steps of the last 10 s
    decode_step_base_us: int = 0
    decode_step_us_per_ktoken: int = 0
    decode_context_tokens: int = 0
    decode_token_interval_us: int = 0

    @property
    def context_per_token_us(self) -> float:
        """The context its streams keep in flight per microsecond of their time per token: by
        Little's law that follows its arrivals, not how fast its steps run (0: not known)."""
        if not self.decode_token_interval_us:
            return 0.0
        return self.decode_context_tokens / self.decode_token_interval_us

    def settled_decode_step_ms(self, context_per_token_us: float) -> float:
        """The decode step its line settles at where arrivals keep `context_per_token_us`: step
        = base + slope x context with context = that x step, so step = base / (1 - slope x
        that); inf where the steps would grow without end, 0 where its line is not known."""
        if not self.decode_step_base_us:
            return 0.0
        load = self.decode_step_us_per_ktoken / 1000 * context_per_token_us
        return math.inf if load >= 1 else self.decode_step_base_us / (1 - load) / 1000

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


NO_LOAD = WorkerLoad()  # a worker that reports none (vLLM's) counts as idle


@dataclass
class Worker:
    url: str
    role: Role
    model: str | None = None
    static: bool = True
    healthy: bool = False
    consecutive_failures: int = 0
    last_heartbeat: float = 0.0
    outstanding: int = 0
    # prompt tokens of the legs in flight that it has not yet prefilled, as far as the router
    # can tell (a prefill leg until its answer, a plain leg until its first byte): fresher than
    # its load report, which a health round brings once a second (`queued_tokens`)
    prompt_tokens_in_flight: int = 0
    checking: bool = False
    # tandem workers' /health tells their KV transport and, for a prefill worker, where a decode
    # worker waits for its handoff announcements; None for other workers (vLLM's, say).
    kv_endpoint: dict[str, Any] | None = None
    # the worker's /v1/models entries (id, created, max_model_len, ...), read when it enters
    # the pool
    model_cards: list[dict[str, Any]] | None = None
    load: WorkerLoad = NO_LOAD
    # an auto worker's duty now: "prefill" (prefill legs) or "decode" (decode legs and whole
    # requests); None for the other roles
    assigned: Role | None = None
    unanswered_since: float | None = None  # when its health checks began to go unanswered
    _lost: asyncio.Future[str] | None = field(default=None, repr=False)

    def when_lost(self) -> asyncio.Future[str]:
        """Resolved, with the reason, once the pool gives this worker up for lost."""
        if self._lost is None:
            self._lost = asyncio.get_running_loop().create_future()
        return self._lost

    def give_up(self, reason: str) -> None:
        """Ends what waits on `when_lost()`; a later wait gets a new, unresolved signal."""
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(reason)
        self._lost = None

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens it has yet to compute: its load report's, or what the router sent it
        and has not seen prefilled, whichever is more. A report is up to a health round old: a
        burst of long prompts within one round would all go to a full prefill queue (Dynamo's
        router counts its own sends alike)."""
        return max(self.load.tokens_waiting, self.prompt_tokens_in_flight)

    @property
    def serving_role(self) -> Role:
        """The role the router treats this worker as now: its own, or an auto worker's duty."""
        if self.role == "auto":
            return self.assigned or "decode"
        return self.role

    @property
    def takes_handoffs(self) -> bool:
        """A decode worker that can wait for a handoff, or a prefill worker that announces
        them on its KV server."""
        endpoint = self.kv_endpoint or {}
        if not endpoint.get("handoff"):
            return False
        if self.serving_role == "prefill":
            return isinstance(endpoint.get("host"), str) and isinstance(endpoint.get("port"), int)
        return True

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "role": self.role,
            "assigned": self.assigned,
            "model": self.model,
            "static": self.static,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "prompt_tokens_in_flight": self.prompt_tokens_in_flight,
            "load": vars(self.load),
        }


def kv_endpoint_of(health_body: bytes) -> dict[str, Any] | None:
    """The `kv` object of a tandem worker's /health answer, if the answer has a valid one."""
    try:
        endpoint = json.loads(health_body).get("kv")
    except (ValueError, AttributeError):
        return None
    if not isinstance(endpoint, dict) or not isinstance(endpoint.get("transport"), str):
        return None
    return endpoint


def load_of(health_body: bytes) -> WorkerLoad:
    """The load report of a tandem worker's /health answer; NO_LOAD without a valid one."""
    try:
        report = json.loads(health_body).get("load")
    except (ValueError, AttributeError):
        return NO_LOAD
    if not isinstance(report, dict):
        return NO_LOAD
    fields = {
        name: value
        for name in WorkerLoad.__dataclass_fields__
        if isinstance(value := report.get(name), int) and value >= 0
    }
    return WorkerLoad(**fields)


class WorkerPool:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._workers: dict[str, Worker] = {}
        self.planner = Planner(config, metrics)
        for role, urls in (
            ("prefill", config.prefill_urls),
            ("decode", config.decode_urls),
            ("both", config.both_urls),
            ("auto", config.auto_urls),
        ):
            for url in urls:
                self._add(Worker(url=url, role=role, static=True))

    # ---- membership -------------------------------------------------------------------------

    def _add(self, worker: Worker) -> None:
        self._workers[worker.url] = worker
        self._publish(worker)

    def _publish(self, worker: Worker) -> None:
        self._metrics.healthy.labels(worker.url, worker.role).set(1 if worker.healthy else 0)
        self._metrics.outstanding.labels(worker.url, worker.role).set(worker.outstanding)

    def register(self, url: str, role: Role, model: str | None) -> Worker:
        """Add a worker that announced itself, or refresh one already known (a heartbeat)."""
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is not None and worker.role != role:
            self._metrics.forget_worker(worker.url, worker.role)
            worker.role, worker.assigned = role, None
        if worker is None:
            worker = Worker(url=url, role=role, static=False)
            self._workers[url] = worker
            logger.info("worker %s (%s) registered", url, role)
        if model:
            worker.model = model
        worker.last_heartbeat = time.monotonic()
        self._publish(worker)
        return worker

    def deregister(self, url: str) -> bool:
        worker = self._workers.get(normalize_url(url))
        if worker is None:
            return False
        if worker.static:
            worker.healthy = False
            self._publish(worker)
        else:
            del self._workers[worker.url]
            self._metrics.forget_worker(worker.url, worker.role)
        logger.info("worker %s (%s) deregistered", worker.url, worker.role)
        return True

    def _expire_silent(self) -> None:
        deadline = time.monotonic() - self._config.heartbeat_timeout_s
        for worker in list(self._workers.values()):
            if not worker.static and worker.last_heartbeat < deadline:
                del self._workers[worker.url]
                self._metrics.forget_worker(worker.url, worker.role)
                logger.warning("worker %s (%s) missed its heartbeats", worker.url, worker.role)
                timeout = self._config.heartbeat_timeout_s
                worker.give_up(f"its heartbeats stopped for {timeout:g} s")

    # ---- queries ----------------------------------------------------------------------------

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def available(self, roles: Iterable[Role], exclude: Iterable[str] = ()) -> list[Worker]:
        """Workers in the pool serving one of `roles` now (an auto worker: its duty), minus the
        URLs in `exclude`."""
        deadline = time.monotonic() - self._config.heartbeat_timeout_s
        excluded = set(exclude)
        return [
            worker
            for worker in self._workers.values()
            if worker.serving_role in roles
            and worker.healthy
            and (worker.static or worker.last_heartbeat >= deadline)
            and worker.url not in excluded
        ]

    def counts(self) -> dict[str, int]:
        """Workers in the pool, by the role they serve now (an auto worker: its duty)."""
        return {role: len(self.available((role,))) for role in ("prefill", "decode", "both")}

    def models(self) -> list[str]:
        seen = (worker.model for worker in self.available(ROLES) if worker.model)
        return list(dict.fromkeys(seen))

    def model_cards(self) -> list[dict[str, Any]]:
        """The /v1/models entries of the workers in the pool, one per model name: the workers'
        own (created, max_model_len, ...), or a bare one for a worker whose list was not read."""
        cards: dict[str, dict[str, Any]] = {}
        for worker in self.available(ROLES):
            for card in worker.model_cards or []:
                cards.setdefault(card["id"], card)
            if worker.model and worker.model not in cards:
                cards[worker.model] = {"id": worker.model, "object": "model", "owned_by": "tandem"}
        return list(cards.values())

    # ---- load and health --------------------------------------------------------------------

    def begin(self, worker: Worker, prompt_tokens: int = 0) -> None:
        """Count one more request in flight on `worker`, with the prompt tokens it is to
        compute for it; `finish` undoes it (`prefilled` the tokens alone, earlier)."""
        worker.outstanding += 1
        worker.prompt_tokens_in_flight += prompt_tokens
        self._metrics.outstanding.labels(worker.url, worker.role).set(worker.outstanding)

    @staticmethod
    def prefilled(worker: Worker, prompt_tokens: int) -> None:
        worker.prompt_tokens_in_flight -= prompt_tokens

    def finish(self, worker: Worker, prompt_tokens: int = 0) -> None:
        self.prefilled(worker, prompt_tokens)
        worker.outstanding -= 1
        if self._workers.get(worker.url) is worker:
            self._metrics.outstanding.labels(worker.url, worker.role).set(worker.outstanding)

    def mark_down(self, worker: Worker, reason: str) -> None:
        """Take a worker out of the pool at once (it refused a connection or dropped one)."""
        if worker.healthy:
            logger.warning("worker %s (%s) is down: %s", worker.url, worker.role, reason)
        worker.healthy = False
        worker.consecutive_failures = max(worker.consecutive_failures, 1)
        self._publish(worker)

    def _record_check(self, worker: Worker, ok: bool, unanswered_since: float | None) -> None:
        """One check's result; `unanswered_since` is when the check was sent if it got no
        answer at all (timed out, or the connection broke), else None."""
        if self._workers.get(worker.url) is not worker:
            return  # forgotten while its check was in flight
        if unanswered_since is None:
            worker.unanswered_since = None
        elif worker.unanswered_since is None:
            worker.unanswered_since = unanswered_since
        if ok:
            if not worker.healthy:
                logger.info("worker %s (%s) is healthy", worker.url, worker.role)
            worker.healthy = True
            worker.consecutive_failures = 0
        else:
            worker.consecutive_failures += 1
            if worker.healthy and worker.consecutive_failures >= self._config.health_failures:
                logger.warning("worker %s (%s) failed its health checks", worker.url, worker.role)
                worker.healthy = False
            silent_s = time.monotonic() - (worker.unanswered_since or time.monotonic())
            if not worker.healthy and silent_s >= self._config.read_timeout_s:
                worker.give_up(f"its health checks went unanswered for {silent_s:.1f} s")
        self._publish(worker)

    async def check(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        """Health-check one worker, unless a check of it is already in flight."""
        if worker.checking:
            return
        worker.checking = True
        try:
            await self._check(session, worker)
        finally:
            worker.checking = False

    async def _check(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self._config.health_timeout_s)
        sent = time.monotonic()
        unanswered_since = None
        try:
            async with session.get(worker.url + "/health", timeout=timeout) as response:
                ok = response.status == 200
                if ok:
                    answer = await response.read()
                    worker.kv_endpoint = kv_endpoint_of(answer)
                    worker.load = load_of(answer)
            if ok and (worker.model_cards is None or not worker.healthy):
                await self._read_models(session, worker, timeout)
        except aiohttp.ClientConnectorError as exc:  # refused: draining, or dead
            ok = False
            if not isinstance(exc.os_error, ConnectionRefusedError):
                unanswered_since = sent
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
            unanswered_since = sent
        except (ValueError, KeyError, TypeError, AttributeError):  # not a worker's answer
            ok = False
        self._record_check(worker, ok, unanswered_since)

    @staticmethod
    async def _read_models(
        session: aiohttp.ClientSession, worker: Worker, timeout: aiohttp.ClientTimeout
    ) -> None:
        """Reads the worker's /v1/models entries (and its model's name, unless it told it)."""
        async with session.get(worker.url + "/v1/models", timeout=timeout) as response:
            if response.status == 200:
                cards = (await response.json()).get("data") or []
                worker.model_cards = [
                    card
                    for card in cards
                    if isinstance(card, dict) and isinstance(card.get("id"), str)
                ]
                if worker.model is None and worker.model_cards:
                    worker.model = worker.model_cards[0]["id"]
            elif response.status == 401:
                logger.warning(
                    "worker %s wants an API key the router does not send: give the "
                    "router the workers' key (--api-key)",
                    worker.url,
                )

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """One health round: expire silent registered workers, check every known one, then let
        the planner assign the auto workers' duties from the fresh load reports."""
        self._expire_silent()
        workers = list(self._workers.values())
        await asyncio.gather(*(self.check(session, worker) for worker in workers))
        self.planner.plan(self.available(ROLES))

    async def run_health_checks(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self._config.health_interval_s)
            await self.check_all(session)
