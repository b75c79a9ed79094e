"""One API server over a prefill engine and a decode engine: PD without a router in between.

`tandem worker --role pd` runs two engine core processes behind one HTTP server: the prefill
engine on `--device`, the decode engine on `--decode-device` (by default the next GPU). A
request is parsed and tokenized once; its two legs go to the two engines at once as a handoff
(docs/protocol.md): the decode engine waits on the prefill engine's KV server and loads the
prompt's blocks over the KV transport (cuda-ipc on GPUs, TCP on CPU). The client's first token
is the prefill's, sent as soon as the prefill engine has it; the rest are the decode's. Requests
one engine must serve whole (n > 1, prompt logprobs) go to the decode engine, one-token requests
to the prefill engine.

`DisaggregatedClient` has the surface of `AsyncEngineClient`, so the HTTP layer is the worker's.
The handoff itself is `pd.hand_off`'s, the router's orchestration; `EngineLegs` are its legs on
the two engine clients.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec

from tandem.engine.config import EngineConfig, cuda_available
from tandem.engine.messages import EngineInfo
from tandem.engine.processor import SequenceDelta
from tandem.engine.sampling_params import SamplingParams
from tandem.kv.params import KVTransferParams
from tandem.pd.handoff import FirstToken, hand_off
from tandem.pd.params import handoff_decode_params, prefill_params
from tandem.pd.text import stop_hold_back
from tandem.server.engine_client import AsyncEngineClient, RequestStream


def place_engines(config: EngineConfig, decode_device: str) -> tuple[EngineConfig, EngineConfig]:
    """The prefill engine's and the decode engine's settings. `decode_device` "auto" means the
    GPU after the prefill's when there is one, else the prefill's device; two engines on one GPU
    take half of `gpu_memory_utilization` each."""
    prefill_device = config.device
    if prefill_device == "auto":
        prefill_device = "cuda:0" if cuda_available() else "cpu"
    elif prefill_device == "cuda":
        prefill_device = "cuda:0"
    if decode_device == "auto":
        decode_device = prefill_device
        if prefill_device.startswith("cuda"):
            import torch

            if count := torch.cuda.device_count():
                index = int(prefill_device.partition(":")[2] or 0)
                decode_device = f"cuda:{(index + 1) % count}"
    elif decode_device == "cuda":
        decode_device = "cuda:0"
    utilization = config.gpu_memory_utilization
    if decode_device == prefill_device and prefill_device != "cpu":
        utilization /= 2
    return (
        dataclasses.replace(config, device=prefill_device, gpu_memory_utilization=utilization),
        dataclasses.replace(config, device=decode_device, gpu_memory_utilization=utilization),
    )


class DisaggregatedClient:
    """The prefill engine's and the decode engine's clients, as one engine client."""

    def __init__(self, prefill: AsyncEngineClient, decode: AsyncEngineClient) -> None:
        self.prefill = prefill
        self.decode = decode
        self.info: EngineInfo | None = None
        self._latest_stats: dict[str, dict[str, Any]] = {}
        self.stats_listener: Callable[[dict[str, Any]], None] | None = None
        # told when either engine process dies (the server cannot go on with one)
        self.death_listener: Callable[[str], None] | None = None
        prefill.stats_listener = lambda stats: self._report_stats("prefill", stats)
        decode.stats_listener = lambda stats: self._report_stats("decode", stats)
        prefill.death_listener = lambda cause: self._report_death("prefill", cause)
        decode.death_listener = lambda cause: self._report_death("decode", cause)

    # -- what the HTTP layer reads ---------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.prefill.healthy and self.decode.healthy

    @property
    def tokenizer(self):
        return self.decode.tokenizer

    @property
    def inputs(self):
        return self.decode.inputs

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self.decode.sampling_defaults

    def new_request_id(self) -> str:
        return self.decode.new_request_id()

    def _report_stats(self, engine: str, stats: dict[str, Any]) -> None:
        self._latest_stats[engine] = stats
        if self.stats_listener is None:
            return
        # The counts (gauges, cumulative counters) add up over the two engines' latest reports;
        # the per-report lists (transfer times, failures) pass through as this engine sent them.
        merged = {
            key: sum(latest.get(key, 0) for latest in self._latest_stats.values())
            if isinstance(value, int | float)
            else value
            for key, value in stats.items()
        }
        self.stats_listener(merged)

    def _report_death(self, engine: str, cause: str) -> None:
        if self.death_listener is not None:
            self.death_listener(f"the {engine} engine: {cause}")

    # -- life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        # One tokenizer load for both (two threads importing transformers at once can fail).
        front_end = asyncio.ensure_future(asyncio.to_thread(self.decode.load_front_end))
        results = await asyncio.gather(
            self.prefill.start(front_end), self.decode.start(front_end), return_exceptions=True
        )
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            await self.shutdown()
            raise failures[0]
        limit = min(self.prefill.info.max_model_len, self.decode.info.max_model_len)
        self.info = msgspec.structs.replace(self.decode.info, max_model_len=limit, kv_port=None)
        self.inputs.max_model_len = limit

    async def shutdown(self) -> None:
        await asyncio.gather(self.prefill.shutdown(), self.decode.shutdown())

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[SequenceDelta]:
        """The request's deltas: split into a handoff when it can be, else from one engine."""
        if kv_transfer_params:
            raise ValueError("this server runs both legs itself; send no kv_transfer_params")
        if params.max_tokens == 1 or params.n > 1 or params.prompt_logprobs is not None:
            engine = self.prefill if params.max_tokens == 1 else self.decode
            async for delta in engine.generate(request_id, prompt_token_ids, params):
                yield delta
            return
        async for delta in self._handed_off(request_id, prompt_token_ids, params):
            yield delta

    async def _handed_off(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[SequenceDelta]:
        handoff_id = uuid.uuid4().hex
        waiting = handoff_decode_params(
            handoff_id,
            self.prefill.kv_config.host,
            self.prefill.info.kv_port,
            self.prefill.kv_config.transport,
        )
        legs = EngineLegs(self, request_id, prompt_token_ids, params, handoff_id)
        hold_back = stop_hold_back(params.stop, params.include_stop_str_in_output)
        async for delta in hand_off(legs, hold_back=hold_back, handoff=waiting):
            yield delta

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(self.prefill.abort(request_id), self.decode.abort(request_id))

    async def release_kv(self, remote_request_id: str) -> bool:
        return await self.prefill.release_kv(remote_request_id)


class EngineLegs:
    """A request's two legs on the two engines (`pd.handoff.HandoffLegs`). Both are read in the
    caller's task: the first token wakes it with no hop between."""

    def __init__(
        self,
        client: DisaggregatedClient,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handoff_id: str,
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.handoff_id = handoff_id
        self.lease_taken = False
        self.prefill_stream: RequestStream | None = None
        self.decode_stream: RequestStream | None = None
        self.first: SequenceDelta | None = None
        self.shown_text = ""  # the first token's text as the client got it

    async def start_prefill(self) -> None:
        self.prefill_stream = await self.client.prefill.submit(
            self.request_id,
            self.prompt_token_ids,
            self.params,  # the prefill engine samples the first token only (do_remote_decode)
            prefill_params(self.handoff_id),
        )

    async def start_decode(self, params: KVTransferParams) -> None:
        # The decode engine waits on the prefill's KV server for the handoff's announcement,
        # which the prefill engine makes once the prompt's KV is computed.
        self.decode_stream = await self.client.decode.submit(
            self.request_id, self.prompt_token_ids, self.params, params
        )

    async def prefill(self) -> FirstToken:
        assert self.prefill_stream is not None
        self.first = first = await self.prefill_stream.next()
        await self.prefill_stream.close()  # done on its one token: its state here goes
        # the first token ended the request, or the prefill failed
        ends_request = first.finish_reason in ("stop", "error")
        return FirstToken(first.text, first.kv_transfer_params, ends_request)

    def prefill_alone(self, first: FirstToken) -> list[SequenceDelta]:
        assert self.first is not None
        return [self.first]

    async def decode_refused(self) -> None:
        return None  # a refusal raised at submit

    def first_token(self, first: FirstToken, shown_text: str) -> list[SequenceDelta]:
        assert self.first is not None
        unfinished = dict(finish_reason=None, stop_reason=None, kv_transfer_params=None)
        self.shown_text = shown_text
        return [dataclasses.replace(self.first, text=shown_text, **unfinished)]

    async def continuation(self) -> AsyncGenerator[SequenceDelta, None]:
        """The decode engine's deltas, less the first token's id, logprob and the text the
        client has of it (the engine emits that token in a delta of its own)."""
        assert self.decode_stream is not None and self.first is not None
        delta = await self.decode_stream.next()
        self.lease_taken = delta.finish_reason != "error"
        first_left = True
        while True:
            token_ids, logprobs, text = delta.token_ids, delta.logprobs, delta.text
            if first_left and token_ids:
                token_ids, logprobs = token_ids[1:], logprobs[1:] if logprobs else logprobs
                text = text[len(self.shown_text) :]
                first_left = False
            if token_ids or text or delta.finish_reason:
                yield dataclasses.replace(
                    delta,
                    text=text,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    num_cached_tokens=self.first.num_cached_tokens,  # the prompt's, at prefill
                )
            if delta.finish_reason is not None:
                return
            delta = await self.decode_stream.next()

    async def release(self, lease: KVTransferParams) -> None:
        assert lease.remote_request_id is not None
        await self.client.prefill.release_kv(lease.remote_request_id)

    async def close(self) -> None:
        if self.prefill_stream is not None and self.decode_stream is None and self.first is None:
            await self.client.prefill.abort(self.request_id)  # its lease too, if it is done
        for stream in (self.decode_stream, self.prefill_stream):
            if stream is not None:
                await stream.close()
