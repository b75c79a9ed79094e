"""The router's flows: plain (one leg, relayed) and disaggregated (two legs, `pd.hand_off`),
and the conditional choice between them (decide.py) on a decode worker chosen first.

Disaggregated, vLLM's flow (sequential): the prefill leg (stream false, max_tokens 1,
kv_transfer_params.do_remote_decode), then the decode leg with the prefill answer's params. A
handoff, tandem's flow for streams when every prefill worker has decode workers on its KV
transport: the decode leg goes out with the prefill leg, carrying a handoff id, and waits on the
prefill worker's KV server for its announcement (docs/protocol.md); if the chosen prefill worker
refuses, the sequential flow takes over. The client sees the same stream either way.

`HttpLegs` is the two legs over HTTP, as `pd.hand_off` drives them; the order of the legs, the
first token, its splice and the lease release are `hand_off`'s.

Invariants:
* A prefill leg that fails without an answer (its worker died, or was given up for lost: hung,
  its health checks unanswered; or none was left to try) sends the request whole to a decode
  worker: nothing had reached the client, and a decode worker serves whole requests too.
* After the first byte, a failure ends the stream with an error event and `data: [DONE]`.
* The decode leg is retried on another decode worker while none of its bytes reached the client
  (the prefill lease still holds the KV).
* A client that leaves mid-decode leaves the lease to the decode worker, which sees its
  connection close; on every other path where the decode leg did not finish, it is released.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import aiohttp
import msgspec

from tandem.kv.params import KVTransferParams
from tandem.pd.handoff import FirstToken, hand_off
from tandem.pd.params import from_wire, handoff_decode_params, to_wire
from tandem.pd.text import stop_hold_back
from tandem.router.chunks import DecodeChunks, first_chunk, prefill_only_chunks, usage_options
from tandem.router.classify import choice_text, prefill_leg_body, wants_one_token
from tandem.router.config import RouterConfig
from tandem.router.decide import cached_units, decide, estimated_tokens
from tandem.router.dispatch import (
    LEG_FAILURES,
    STREAM_FAILURES,
    Dispatcher,
    RequestContext,
    failure_answer,
    failure_event,
    refusal,
    relayed,
    waiting_on_workers,
)
from tandem.router.legs import Leg, NoWorker, give_up
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import (
    PinnedPolicy,
    Policy,
    PreferredPolicy,
    PrefixIndex,
    make_policy,
    prefix_hashes,
    prompt_units,
)
from tandem.router.relay import (
    DONE_EVENT,
    JSON_HEAD,
    SSE_HEAD,
    ResponseHead,
    error_event,
    iter_sse_data,
    sse_event,
)
from tandem.router.workers import Worker, WorkerPool

Flow = AsyncGenerator[ResponseHead | bytes, None]
Answer = Sequence[ResponseHead | bytes]

logger = logging.getLogger(__name__)


class PrefillFailed(Exception):
    """The prefill leg failed without an answer, before anything went to the client."""


class HttpLegs:
    """A request's prefill and decode legs over HTTP (`pd.handoff.HandoffLegs`)."""

    def __init__(
        self,
        flows: Flows,
        ctx: RequestContext,
        prefix: Sequence[int],
        pinned: Worker | None = None,
        handoff_id: str | None = None,
        decode_policy: Policy | None = None,
    ) -> None:
        self.flows = flows
        self.decode_policy = decode_policy or flows.decode_policy
        self.dispatch = flows.dispatch
        self.ctx = ctx
        self.prefix = prefix
        self.pinned = pinned  # the prefill worker a handoff chose: no other is tried
        self.handoff_id = handoff_id
        self.lease_taken = False
        self.prefill_worker: Worker | None = None
        self.answer: dict[str, Any] = {}
        self.opening: asyncio.Future[Leg] | None = None
        self.decode_leg: Leg | None = None

    async def start_prefill(self) -> None:
        """Nothing: `prefill` sends the leg (its retries are part of waiting for it)."""

    async def start_decode(self, params: KVTransferParams) -> None:
        body = dict(self.ctx.body, kv_transfer_params=to_wire(params))
        pinned = self.pinned
        accept = None if pinned is None else (lambda worker: can_wait_on(worker, pinned))
        self.opening = asyncio.ensure_future(
            self.dispatch.open_leg(
                self.ctx,
                "decode",
                ("decode",),
                self.decode_policy,
                body,
                self.flows.decode_prefix(self.ctx),
                accept,
            )
        )

    async def prefill(self) -> FirstToken | Answer:
        ctx, pinned = self.ctx, self.pinned
        try:
            with waiting_on_workers(ctx):
                leg = await self.dispatch.open_leg(
                    ctx,
                    "prefill",
                    ("prefill",),
                    self.flows.prefill_policy if pinned is None else PinnedPolicy(),
                    prefill_leg_body(ctx.body, self.handoff_id),
                    self.prefix,
                    None if pinned is None else (lambda worker: worker is pinned),
                    ctx.prefill_tokens,
                )
                data = await self.dispatch.read_leg(leg)
        except LEG_FAILURES as exc:
            if pinned is not None and isinstance(exc, NoWorker):
                raise  # the sequential flow takes over
            raise PrefillFailed(f"{exc!r}") from exc
        if leg.response.status != 200:
            return relayed(ctx, leg, data)
        try:
            answer = msgspec.json.decode(data)
            first_choice = answer["choices"][0]
            raw_params = answer.get("kv_transfer_params")
            lease = None if raw_params is None else from_wire(raw_params)
        except (ValueError, KeyError, IndexError, TypeError):
            message = f"the prefill worker {leg.worker.url} sent a malformed answer"
            return refusal(ctx, 502, message, "upstream_error", "upstream_error")
        self.prefill_worker, self.answer = leg.worker, answer
        text = choice_text(ctx.endpoint, first_choice, streamed=False)
        return FirstToken(text, lease, ends_request=wants_one_token(ctx.endpoint, ctx.body))

    def prefill_alone(self, first: FirstToken) -> Answer:
        if self.opening is not None:
            give_up(self.opening)
        answer = self.answer
        answer.pop("kv_transfer_params", None)
        if not self.ctx.stream:
            return JSON_HEAD, msgspec.json.encode(answer)
        ctx = self.ctx
        text = first.text  # the whole of it: the request ends there
        return SSE_HEAD, *prefill_only_chunks(ctx.endpoint, ctx.request_id, answer, text, ctx.body)

    async def decode_refused(self) -> Answer | None:
        opening = self.opening
        assert opening is not None
        if not opening.done() or opening.cancelled() or opening.exception() is not None:
            return None
        leg = opening.result()
        if leg.response.status == 200:
            return None
        # Refused already (a field the prefill leg does not carry, as max_tokens): its answer
        # goes to the client as it is, nothing streamed yet.
        try:
            return relayed(self.ctx, leg, await self.dispatch.read_leg(leg))
        except LEG_FAILURES as exc:
            return failure_answer(self.ctx, exc, "the decode worker")

    def first_token(self, first: FirstToken, shown_text: str) -> Answer:
        ctx = self.ctx
        _, continuous = usage_options(ctx.body)
        event = first_chunk(ctx.endpoint, ctx.request_id, self.answer, shown_text, continuous)
        return SSE_HEAD, event

    async def continuation(self) -> AsyncGenerator[ResponseHead | bytes, None]:
        assert self.opening is not None
        if not self.ctx.stream:
            for item in await self._decode_whole(self.opening):
                yield item
            return
        try:
            self.decode_leg = leg = await self.opening
            if leg.response.status != 200:
                yield await self._refusal_event(leg)
                return
            async for event in self._relay_decode(leg):
                yield event
            self.lease_taken = True
        except STREAM_FAILURES as exc:
            yield failure_event(self.ctx, exc, self.decode_leg)
        except (GeneratorExit, asyncio.CancelledError):
            # the client left mid-decode: the decode worker sees it and frees the lease
            self.lease_taken = self.decode_leg is not None
            raise

    async def _decode_whole(self, opening: asyncio.Future[Leg]) -> Answer:
        try:
            with waiting_on_workers(self.ctx):
                leg = await opening
                data = await self.dispatch.read_leg(leg)
        except LEG_FAILURES as exc:
            return failure_answer(self.ctx, exc, "the decode worker")
        self.lease_taken = leg.response.status == 200
        return relayed(self.ctx, leg, data)

    async def _refusal_event(self, leg: Leg) -> bytes:
        status = leg.response.status
        self.ctx.outcome = "client_error" if status < 500 else "upstream_error"
        try:
            detail = (await self.dispatch.read_leg(leg)).decode(errors="replace")
            message = msgspec.json.decode(detail)["error"]["message"]
        except (aiohttp.ClientError, ValueError, KeyError, TypeError):
            message = f"the decode worker {leg.worker.url} answered {status}"
        return error_event(message, str(status))

    async def _relay_decode(self, leg: Leg) -> AsyncGenerator[bytes, None]:
        """The decode stream as client events (chunks.DecodeChunks)."""
        chunks = DecodeChunks(self.ctx.endpoint, self.ctx.request_id)
        async for payload in iter_sse_data(leg.response.content.iter_any()):
            if payload == b"[DONE]":
                yield DONE_EVENT
                await leg.response.read()  # drained to the end, so the connection can be reused
                return
            event = msgspec.json.decode(payload)
            if "error" in event:
                self.ctx.outcome = "upstream_error"
                yield b"data: " + payload + b"\n\n"
                continue
            rewritten = chunks.rewrite(event)
            if rewritten is not None:
                yield sse_event(rewritten)
        raise aiohttp.ClientPayloadError("the decode stream ended without [DONE]")

    async def release(self, lease: KVTransferParams) -> None:
        assert self.prefill_worker is not None
        self.dispatch.release(self.prefill_worker, lease)

    async def close(self) -> None:
        if self.opening is not None:
            give_up(self.opening)
        if self.decode_leg is not None:
            self.decode_leg.close()


class Flows:
    """Chooses and runs a request's flow."""

    def __init__(
        self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics, dispatch: Dispatcher
    ) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.dispatch = dispatch
        self.prefill_policy: Policy = make_policy(
            config.prefill_policy, config.prefix_balance_threshold
        )
        # what the router sent each decode (and whole-request) worker: KV-aware decode routing
        # and the conditional decision read it
        self.decode_index = PrefixIndex()
        self.decode_policy: Policy = make_policy(
            config.decode_policy, config.prefix_balance_threshold, self.decode_index
        )

    async def plain(self, ctx: RequestContext, policy: Policy | None = None) -> Flow:
        """The body, unchanged, to a decode or `both` worker (`policy`'s choice, else the
        decode policy's); its answer relayed."""
        leg: Leg | None = None
        try:
            with waiting_on_workers(ctx):
                leg = await self.dispatch.open_leg(
                    ctx,
                    "plain",
                    ("decode", "both"),
                    policy or self.decode_policy,
                    ctx.body,
                    self.decode_prefix(ctx),
                    prompt_tokens=ctx.prefill_tokens,
                )
                if leg.response.status != 200 or not ctx.stream:
                    data = await self.dispatch.read_leg(leg)
        except LEG_FAILURES as exc:
            what = "the worker" if leg is None else f"the worker {leg.worker.url}"
            for item in failure_answer(ctx, exc, what):
                yield item
            return
        if leg.response.status != 200 or not ctx.stream:
            for item in relayed(ctx, leg, data):
                yield item
            return
        try:
            yield SSE_HEAD
            finished = False
            async for payload in iter_sse_data(leg.response.content.iter_any()):
                if finished:
                    continue  # drained to the end, so the connection can be reused
                leg.prefilled()
                yield b"data: " + payload + b"\n\n"
                finished = payload == b"[DONE]"
            if not finished:
                raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
        except aiohttp.ClientError as exc:
            yield failure_event(ctx, exc, leg)
        finally:
            leg.close()

    def prompt_hashes(self, ctx: RequestContext) -> list[int]:
        """The prompt's chained block hashes, computed once per request."""
        if ctx.prompt_hashes is None:
            units = prompt_units(ctx.endpoint, ctx.body)
            salt = ctx.body.get("cache_salt")
            ctx.prompt_hashes = prefix_hashes(units, self.config.prefix_block_chars, salt)
        return ctx.prompt_hashes

    def prefill_prefix(self, ctx: RequestContext) -> list[int]:
        """The prompt's block hashes for the prefill policy; none when it has no choice to make
        (one prefill worker): hashing a long prompt costs the prefill leg hundreds of µs."""
        if not self.prefill_policy.uses_prefix or len(self.pool.available(("prefill",))) < 2:
            return []
        return self.prompt_hashes(ctx)

    def decode_prefix(self, ctx: RequestContext) -> list[int]:
        """The prompt's block hashes for the decode side: none unless the decode policy or the
        conditional decision reads them."""
        if ctx.prompt_hashes is None and not self.decode_policy.uses_prefix:
            return []
        return self.prompt_hashes(ctx)

    def conditional(self, ctx: RequestContext) -> Flow:
        """Conditional disaggregation (decide.py): the decode worker is chosen first, then the
        request goes whole to it or disaggregated with its decode leg on it."""
        hashes = self.prompt_hashes(ctx)
        prefills = self.pool.available(("prefill",))
        decoders = self.pool.available(("decode",))
        if not prefills or not decoders:
            reason = "no_decode_worker" if prefills else "no_prefill_worker"
            self.metrics.pd_decisions.labels("whole", reason).inc()
            return self.plain(ctx)
        matched = {
            worker.url: self.decode_index.matched_blocks(worker, hashes) for worker in decoders
        }
        chosen = self.decode_policy.choose(decoders, hashes)
        self.decode_index.remember(chosen, hashes)
        units = prompt_units(ctx.endpoint, ctx.body)
        uncached = None
        if units:
            cached = cached_units(units, matched[chosen.url], self.config.prefix_block_chars)
            ctx.decode_cached_tokens = estimated_tokens(units, cached)
            uncached = estimated_tokens(units, len(units) - cached)
            self.metrics.decode_prefix_tokens.labels("hit").inc(ctx.decode_cached_tokens)
            self.metrics.decode_prefix_tokens.labels("miss").inc(uncached)
        decision = decide(self.config, uncached, prefills, chosen)
        self.metrics.pd_decisions.labels(decision.name, decision.reason).inc()
        preferred = PreferredPolicy(chosen, self.decode_policy)
        if decision.disaggregate:
            # the prefill worker computes the whole prompt (as far as the router knows)
            ctx.prefill_tokens = estimated_tokens(units, len(units)) if units else 0
            return self.disaggregated(ctx, preferred)
        ctx.prefill_tokens = uncached or 0
        return self.plain(ctx, preferred)

    def handoff_worker(self, ctx: RequestContext, prefix: Sequence[int]) -> Worker | None:
        """The prefill worker to hand a streamed request off from, or None for vLLM's flow:
        handoffs need prefill workers and decode workers that take them over one transport."""
        if not (self.config.handoff and ctx.stream) or wants_one_token(ctx.endpoint, ctx.body):
            return None
        # Every prefill worker must qualify: the policy chooses once, for whichever flow runs.
        prefills, decoders = self.pool.available(("prefill",)), self.pool.available(("decode",))
        if not all(
            worker.takes_handoffs and any(can_wait_on(decoder, worker) for decoder in decoders)
            for worker in prefills
        ):
            return None
        return self.prefill_policy.choose(prefills, prefix)

    async def disaggregated(self, ctx: RequestContext, decode_policy: Policy | None = None) -> Flow:
        """Two legs; the decode leg's worker is `decode_policy`'s choice (else the decode
        policy's). The request goes whole to that worker if the prefill leg fails."""
        try:
            async for item in self._two_legs(ctx, decode_policy):
                yield item
            return
        except PrefillFailed as failed:
            logger.warning("request %s: the prefill leg failed (%s); served whole", ctx.request_id,
                           failed)  # fmt: skip
        self.metrics.pd_decisions.labels("whole", "prefill_failed").inc()
        async for item in self.plain(ctx, decode_policy):
            yield item

    async def _two_legs(self, ctx: RequestContext, decode_policy: Policy | None) -> Flow:
        prefix = self.prefill_prefix(ctx)
        hold_back = stop_hold_back(
            ctx.body.get("stop"), bool(ctx.body.get("include_stop_str_in_output"))
        )
        handoff_from = self.handoff_worker(ctx, prefix)
        if handoff_from is not None:
            self.metrics.handoffs.inc()
            handoff_id = uuid.uuid4().hex
            endpoint = handoff_from.kv_endpoint or {}
            params = handoff_decode_params(
                handoff_id,
                endpoint.get("host"),
                endpoint.get("port"),
                endpoint.get("transport"),
                endpoint.get("engine_id"),
            )
            legs = HttpLegs(
                self, ctx, prefix, handoff_from, handoff_id, decode_policy=decode_policy
            )
            handed_off = hand_off(legs, hold_back=hold_back, handoff=params)
            try:
                async for item in handed_off:
                    yield item
                return
            except NoWorker:  # the chosen prefill worker refused before anything was sent
                pass
            finally:
                await handed_off.aclose()
        sequential = hand_off(
            HttpLegs(self, ctx, prefix, decode_policy=decode_policy),
            hold_back=hold_back,
            first_to_client=ctx.stream,
        )
        try:
            async for item in sequential:
                yield item
        finally:
            await sequential.aclose()


def can_wait_on(decode_worker: Worker, prefill_worker: Worker) -> bool:
    """Whether the decode worker takes handoffs over the prefill worker's KV transport."""
    transport = (prefill_worker.kv_endpoint or {}).get("transport")
    return (
        decode_worker.takes_handoffs
        and (decode_worker.kv_endpoint or {}).get("transport") == transport
    )
