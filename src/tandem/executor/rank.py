"""One rank of a tensor-parallel executor (`Rank`: its shard of the model, its KV cache and its
runner, in whichever process runs it), and the messages rank 0 sends the other ranks.

    rank 0 -> rank r:  PlanKVCache | InitializeKVCache | ExecuteModel | Shutdown   (msgpack)
    rank r -> rank 0:  RankReply (started, loaded, planned, initialized; or the error)

Invariants: every rank runs the same calls in the same order (each forward's collectives pair
up across ranks); only rank 0 samples: the other ranks' runners take `NoSampling`, which
stands in for the sampler and whose results nobody reads. Every rank captures the same decode
CUDA graphs (its collectives captured with them) and replays one exactly when rank 0 does, as
the choice depends on the step's SchedulerOutput alone; piecewise prefill graphs stay off at
more than one rank, where those steps run eagerly with the Triton kernels per rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec
import torch

from tandem.attention.base import get_backend
from tandem.distributed.group import TensorParallelGroup
from tandem.engine.config import EngineConfig
from tandem.engine.outputs import ScheduledRequest, SchedulerOutput, TokenLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.executor.runner import KVCacheSpec, ModelRunner, plan_kv_cache
from tandem.executor.sampler import HostCopy, SampledTokens, Sampler
from tandem.kv.connector.base import KVConnectorWorker, RankKVTransfer
from tandem.models.loader import load_model
from tandem.models.source import ModelSource


class PlanKVCache(msgspec.Struct, tag=True):
    """Size this rank's KV cache (on CUDA, profiled: a forward pass on every rank)."""


class InitializeKVCache(msgspec.Struct, tag=True):
    num_blocks: int  # the fewest any rank has room for
    max_model_len: int
    kv_transfer: RankKVTransfer | None = None  # a PD role: how the rank's KV shard moves


class RankRequest(msgspec.Struct, array_like=True):
    """One scheduled request as the other ranks get it (`for_other_ranks`): what their forward
    reads, no sampling inputs (they sample nothing: `NoSampling`), and of its block table only
    the ids they do not hold from the step before."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids_known: int  # how many of its block ids the ranks hold; 0: the whole table is here
    new_block_ids: list[int]  # the rest of its table
    sample: bool
    output_index: int
    # while this step computes its prompt logprobs (every rank takes part in their gather)
    prompt_logprobs: int | None = None
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)


class ExecuteModel(msgspec.Struct, tag=True):
    """A step, as the other ranks get it: `for_other_ranks` of rank 0's SchedulerOutput."""

    requests: list[RankRequest]
    num_batched_tokens: int
    kv_connector_metadata: Any = None


def for_other_ranks(scheduler_output: SchedulerOutput, tables: BlockTables) -> ExecuteModel:
    """The step as the other ranks need it. Its sampling inputs (sampling parameters, output
    tokens, grammar masks) stay on rank 0, and so does its prompt unless this step computes its
    prompt logprobs; of each block table only what the ranks do not hold yet (`tables`). A
    message of every request whole grew with their contexts and parameters: 1.7 MB, 3 ms to
    encode and 22 ms to decode at 64 requests of 8k tokens (CPU, msgspec; benchmarks/
    rank_messages.py has the current sizes)."""
    known = tables.known_of(scheduler_output.requests)
    requests = []
    for request, count in zip(scheduler_output.requests, known, strict=True):
        logprobs = computes_prompt_logprobs(request)
        requests.append(
            RankRequest(
                request.request_id, request.token_ids, request.start_position, count,
                request.block_ids[count:], request.sample, request.output_index,
                request.sampling_params.prompt_logprobs if logprobs else None,
                request.prompt_token_ids if logprobs else [],
            )
        )  # fmt: skip
    return ExecuteModel(
        requests, scheduler_output.num_batched_tokens, scheduler_output.kv_connector_metadata
    )


@functools.lru_cache(maxsize=64)  # a client picks the values: the cache stays bounded
def parameters_on_other_ranks(prompt_logprobs: int | None) -> SamplingParams:
    """What another rank's runner reads of a request's sampling parameters: its prompt
    logprobs. One object a value, shared by the requests."""
    return SamplingParams(max_tokens=None, prompt_logprobs=prompt_logprobs)


class BlockTables:
    """The block tables of the last step's requests, as the other ranks hold them; rank 0 keeps
    the same to know what to send. A request's table only grows while it runs, so one scheduled
    in consecutive steps is sent the ids added since (none, most decode steps); one that is new,
    resumed after a preemption or was left out of the last step is sent whole. Both ends replace
    their tables with this step's at every message, so they never part and keep nothing of a
    request that has gone."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def known_of(self, requests: Sequence[ScheduledRequest]) -> list[int]:
        """Rank 0: per request, how many of its block ids the ranks hold (a prefix of them)."""
        known, tables = [], {}
        for request in requests:
            held = self.tables.get(request.request_id, [])
            count = len(held)
            known.append(count if request.block_ids[:count] == held else 0)
            tables[request.request_id] = request.block_ids
        self.tables = tables
        return known

    def restore(self, message: ExecuteModel) -> SchedulerOutput:
        """Another rank: the step, each request with its whole block table."""
        requests, tables = [], {}
        for sent in message.requests:
            block_ids = sent.new_block_ids
            if sent.block_ids_known:
                held = self.tables[sent.request_id]
                if len(held) != sent.block_ids_known:
                    raise RuntimeError(
                        f"rank 0 counts {sent.block_ids_known} blocks of a table of {len(held)}"
                    )
                block_ids = held + block_ids
            tables[sent.request_id] = block_ids
            requests.append(
                ScheduledRequest(
                    sent.request_id, sent.token_ids, sent.start_position, block_ids, sent.sample,
                    parameters_on_other_ranks(sent.prompt_logprobs), sent.output_index,
                    sent.prompt_token_ids,
                )
            )  # fmt: skip
        self.tables = tables
        return SchedulerOutput(requests, message.num_batched_tokens, message.kv_connector_metadata)


def computes_prompt_logprobs(request: ScheduledRequest) -> bool:
    """Whether this step's tokens reach into the prompt of a request that wants its logprobs."""
    wanted = request.sampling_params.prompt_logprobs is not None
    return wanted and request.start_position < len(request.prompt_token_ids)


class Shutdown(msgspec.Struct, tag=True):
    pass


RankMessage = PlanKVCache | InitializeKVCache | ExecuteModel | Shutdown
MESSAGE_DECODER = msgspec.msgpack.Decoder(RankMessage)


class RankReply(msgspec.Struct):
    rank: int
    num_blocks: int = 0  # PlanKVCache's answer
    error: str | None = None  # what went wrong, as a sentence


REPLY_DECODER = msgspec.msgpack.Decoder(RankReply)


def peer_memory_dtype(config: EngineConfig) -> torch.dtype | None:
    """The dtype whose small all-reduces go over peer memory (`join_group`), or None."""
    return None if config.disable_custom_all_reduce else getattr(torch, config.dtype)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the CPU, or the r-th GPU from the configured one."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class NoSampling:
    """A rank other than 0 computes no logits (they are gathered on rank 0): its runner's
    sampler samples nothing and answers an unfilled buffer (into which rank 0's samples are
    broadcast under async scheduling) that the host never reads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, logits: None, requests: Sequence[ScheduledRequest]) -> SampledTokens:
        token_ids = torch.empty(len(requests), dtype=torch.int64, device=self.device)
        return SampledTokens(token_ids, HostCopy([]), [], [])

    @staticmethod
    def logprobs_of(logits: None, token_ids: Sequence[int], count: int) -> list[TokenLogprobs]:
        return []


class Rank:
    """This rank's shard of the model (loaded when made), then its KV cache and runner."""

    def __init__(self, config: EngineConfig, source: ModelSource, tp: TensorParallelGroup) -> None:
        self.device = rank_device(config, tp.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.config = replace(config, device=str(self.device))
        self.source = source
        self.tp = tp
        self.model = load_model(
            source,
            get_backend(config.attention_backend),
            config.torch_dtype,
            self.device,
            config.load_format,
            config.seed,
            tp,
            config.enable_expert_parallel,
        )
        self.kv_spec: KVCacheSpec | None = None
        self.runner: ModelRunner | None = None

    def plan_kv_cache(self) -> KVCacheSpec:
        self.kv_spec = plan_kv_cache(self.config, self.model)
        return self.kv_spec

    def initialize_kv_cache(
        self, num_blocks: int, connector: KVConnectorWorker, max_model_len: int
    ) -> None:
        sampler = (
            Sampler(self.source.config.eos_token_ids, self.config.seed)
            if self.tp.is_first
            else NoSampling(self.device)
        )
        self.runner = ModelRunner(
            self.model,
            replace(self.kv_spec, num_blocks=num_blocks),
            self.device,
            sampler,
            connector,
            cuda_graph_max_batch=0 if self.config.enforce_eager else self.config.max_num_seqs,
            max_seq_len=max_model_len,
            piecewise_graph_max_tokens=0,
            async_scheduling=self.config.async_scheduling,
            tp=self.tp,
        )
