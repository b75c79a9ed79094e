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
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.core_process import EngineInfo
from tandem.engine.detokenizer import stop_hold_back
from tandem.engine.processor import SequenceDelta
from tandem.engine.sampling_params import SamplingParams
from tandem.server.engine_client import AsyncEngineClient


def place_engines(config: EngineConfig, decode_device: str) -> tuple[EngineConfig, EngineConfig]:
    """The prefill engine's and the decode engine's settings. `decode_device` "auto" means the
    GPU after the prefill's when there is one, else the prefill's device; two engines on one GPU
    take half of `gpu_memory_utilization` each."""
    prefill_device = config.device
    if prefill_device == "auto":
        prefill_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif prefill_device == "cuda":
        prefill_device = "cuda:0"
    if decode_device == "auto":
        decode_device = prefill_device
        if prefill_device.startswith("cuda") and (count := torch.cuda.device_count()):
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


def prefill_leg_params(params: SamplingParams) -> SamplingParams:
    """The prefill leg samples the first token only; a minimum keeps it from ending there."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


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
        self.info = dataclasses.replace(self.decode.info, max_model_len=limit, kv_port=None)
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
        waiting = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "handoff_id": handoff_id,
            "remote_host": self.prefill.kv_config.host,
            "remote_port": self.prefill.info.kv_port,
            "kv_transport": self.prefill.kv_config.transport,
        }
        # The prefill leg goes in first, the first token's way. The decode engine's wait reaches
        # the prefill's KV server while the prefill runs; an early announcement made before it
        # is kept for it (cuda-ipc), so its copy is still queued before the prefill ends.
        prefill_leg = await self.prefill.submit(
            request_id,
            prompt_token_ids,
            prefill_leg_params(params),
            {"do_remote_decode": True, "do_remote_prefill": False, "handoff_id": handoff_id},
        )
        try:
            decode_leg = await self.decode.submit(request_id, prompt_token_ids, params, waiting)
        except BaseException:
            await self.prefill.abort(request_id)  # its lease too, if it is done already
            await prefill_leg.close()
            raise
        lease: dict[str, Any] | None = None
        handed_over = False
        try:
            # Both legs are read in this task: the first token wakes it with no hop between.
            first = await prefill_leg.next()
            await prefill_leg.close()  # done on its one token: its state here goes
            lease = first.kv_transfer_params
            if first.finish_reason in ("stop", "error") or lease is None:
                yield first  # the first token ended the request, or the prefill failed
                return
            # What the decode engine's output processor sends for the same token, unfinished:
            # the text minus what may start a stop string.
            shown = first.text[: max(0, len(first.text) - stop_hold_back(params))]
            yield dataclasses.replace(
                first, text=shown, finish_reason=None, stop_reason=None, kv_transfer_params=None
            )
            skip_chars, skip_tokens = len(shown), 1
            delta = await decode_leg.next()
            handed_over = delta.finish_reason != "error"
            while True:
                cut = min(skip_chars, len(delta.text))
                num_tokens = min(skip_tokens, len(delta.token_ids))
                skip_chars, skip_tokens = skip_chars - cut, skip_tokens - num_tokens
                if delta.token_ids[num_tokens:] or delta.text[cut:] or delta.finish_reason:
                    yield dataclasses.replace(
                        delta,
                        text=delta.text[cut:],
                        token_ids=delta.token_ids[num_tokens:],
                        logprobs=delta.logprobs[num_tokens:] if delta.logprobs else delta.logprobs,
                        num_cached_tokens=first.num_cached_tokens,  # the prompt's, at prefill
                    )
                if delta.finish_reason is not None:
                    return
                delta = await decode_leg.next()
        finally:
            await decode_leg.close()
            await prefill_leg.close()
            if lease is not None and not handed_over:
                await self.prefill.release_kv(lease["remote_request_id"])

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(self.prefill.abort(request_id), self.decode.abort(request_id))

    async def release_kv(self, remote_request_id: str) -> bool:
        return await self.prefill.release_kv(remote_request_id)
