"""One client request's trip through the workers: the router's entry point.

`Proxy.handle` gives a request its id, routes it to a flow (flows.py: disaggregated when the
body allows it, classify.py, and the pool has a prefill and a decode worker, or with
`--disaggregation conditional` as decide.py says; plain otherwise)
and records its metrics when it ends, however it ends. The pieces:

    classify.py   which flow a body takes; the prefill leg's body
    flows.py      the plain flow; the disaggregated flows over `pd.hand_off` (HttpLegs)
    decide.py     conditional disaggregation: whole on the decode worker, or disaggregated
    policies.py   which worker takes a leg; the per-worker record of prompts sent (KV-aware)
    planner.py    the duties of auto workers, from the workers' load reports (workers.py)
    chunks.py     the stream chunks the router writes, and its rewrite of the decode stream's
    dispatch.py   worker choice and retries, reading a leg, failure answers, lease release
    legs.py       one upstream call, and how it ends when its worker is lost
    relay.py      SSE in and out, error bodies, the ASGI response that streams a flow

Invariants: nothing is sent to the client before the first leg answered (dispatch.py); no leg
has a read timeout, a leg ends early only when its worker is lost (legs.py); every worker counted
in flight by `WorkerPool.begin` is finished exactly once (`Leg.close`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp

from tandem.router.classify import can_disaggregate
from tandem.router.config import RouterConfig
from tandem.router.dispatch import Dispatcher, RequestContext
from tandem.router.flows import Flow, Flows
from tandem.router.metrics import RouterMetrics
from tandem.router.relay import ResponseHead
from tandem.router.workers import WorkerPool


class Proxy:
    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.dispatch = Dispatcher(config, pool, metrics)
        self.flows = Flows(config, pool, metrics, self.dispatch)

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.dispatch.session

    async def start(self) -> None:
        await self.dispatch.start()

    async def close(self) -> None:
        await self.dispatch.close()

    async def forward(self, path: str, payload: bytes) -> tuple[int, str, bytes]:
        return await self.dispatch.forward(path, payload)

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
        if not can_disaggregate(ctx.endpoint, ctx.body):
            flow = self.flows.plain(ctx)
        elif self.config.disaggregation == "conditional":
            flow = self.flows.conditional(ctx)
        elif self.pool.available(("prefill",)) and self.pool.available(("decode",)):
            flow = self.flows.disaggregated(ctx)
        else:
            flow = self.flows.plain(ctx)
        try:
            async for item in flow:
                yield item
        finally:
            await flow.aclose()
