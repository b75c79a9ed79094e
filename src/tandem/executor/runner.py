"""The model runner: owns the KV cache tensor, turns a SchedulerOutput into tensors, runs the
model (any `tandem.models.base.CausalLM`), samples, and drives the KV connector's worker-side
hooks around the forward pass. The uniprocess executor calls it; the engine core never does.

`launch` queues a step on the device and returns without waiting for it; the function it returns
waits for the samples. Under async scheduling the runner keeps each step's samples on the device
(on every rank: rank 0 broadcasts them) for the next step, whose inputs may name them
(`SAMPLED_IN_FLIGHT`).

KV cache layout (one tensor for all layers, so a transfer can gather across layers in bulk):

    kv_cache[layer, 0 = key | 1 = value, block_id, offset_in_block, kv_head, head_dim]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from tandem.attention.base import AttentionMetadata
from tandem.distributed.group import TensorParallelGroup
from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache_manager import slot_of
from tandem.engine.outputs import (
    SAMPLED_IN_FLIGHT,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from tandem.executor.input_staging import InputStaging
from tandem.executor.sampler import Sampler
from tandem.kv.connector.base import KVConnectorWorker
from tandem.models.base import CausalLM

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30
PROMPT_LOGPROBS_ROWS = 512  # prompt positions whose logits are computed at once


@dataclass(frozen=True)
class KVCacheSpec:
    """One rank's KV cache: its KV heads are the model's [kv_head_start, + num_kv_heads)."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_head_start: int = 0
    latent: tuple[int, int] | None = None  # the model's KVCacheLayout.latent (DeepSeek's MLA)

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """(start, count) of this rank's KV heads among the model's (tensor parallelism)."""
        return self.kv_head_start, self.num_kv_heads

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )


def plan_kv_cache(config: EngineConfig, model: CausalLM) -> KVCacheSpec:
    """The model's KV layout in blocks; how many: as asked, else from the memory asked, else
    from what the device has."""
    layout = model.kv_cache_layout()
    spec = KVCacheSpec(
        0,
        config.block_size,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        config.torch_dtype,
        layout.kv_head_start,
        layout.latent,
    )
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // spec.bytes_per_block
    elif config.device == "cpu":
        num_blocks = CPU_DEFAULT_KV_CACHE_BYTES // spec.bytes_per_block
    else:
        num_blocks = _profile_cuda_blocks(config, model, spec)
    if num_blocks < 1:
        raise ValueError("the KV cache settings leave room for no block; give it more memory")
    return replace(spec, num_blocks=num_blocks)


def _profile_cuda_blocks(config: EngineConfig, model: CausalLM, spec: KVCacheSpec) -> int:
    """Run the largest batch once (one sequence of max_num_batched_tokens tokens, in a scratch
    cache just big enough), then give the memory left under gpu_memory_utilization to the KV
    cache."""
    device = torch.device(config.device)
    num_tokens = config.max_num_batched_tokens
    num_blocks = -(-num_tokens // spec.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache = torch.zeros(replace(spec, num_blocks=num_blocks).shape, dtype=spec.dtype, device=device)
    metadata = AttentionMetadata.one_prompt(
        torch.arange(num_tokens, dtype=torch.int64, device=device),
        torch.arange(num_blocks, dtype=torch.int32, device=device),
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model.forward(ids, torch.arange(num_tokens, device=device), cache, metadata)
    model.compute_logits(hidden[-config.max_num_seqs :])
    del cache, hidden
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * config.gpu_memory_utilization - peak) // spec.bytes_per_block


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_spec: KVCacheSpec,
        device: torch.device,
        sampler: Sampler,
        connector: KVConnectorWorker,
        cuda_graph_max_batch: int = 0,
        max_seq_len: int = 0,
        piecewise_graph_max_tokens: int = 0,
        async_scheduling: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.model = model
        self.kv_spec = kv_spec
        self.device = device
        self.sampler = sampler
        self.connector = connector
        self.kv_cache = torch.zeros(kv_spec.shape, dtype=kv_spec.dtype, device=device)
        self.input_staging = InputStaging(device)
        # Async scheduling: the last step's samples on the device, each request's row in them.
        self.async_scheduling = async_scheduling
        self.tp = tp or TensorParallelGroup.single()
        self.last_sampled: torch.Tensor | None = None
        self.last_sampled_rows: dict[str, int] = {}
        # its own pinned buffer: the step's inputs' copy, queued behind the step in flight,
        # may still be reading input_staging's (whose reuse would wait for that step)
        self.in_flight_staging = InputStaging(device)
        connector.register_kv_cache(self.kv_cache)
        self.decode_graphs = None
        # graphs capture the fused kernels' path (the torch paths wait on the host)
        if device.type == "cuda" and cuda_graph_max_batch > 0 and model.fused_ops:
            from tandem.executor.cuda_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                model, self.kv_cache, cuda_graph_max_batch, max_seq_len, kv_spec.block_size
            )
        self.piecewise_graphs = None
        if (
            device.type == "cuda"
            and model.fused_ops
            and model.piecewise_capturable
            and piecewise_graph_max_tokens >= 16
        ):
            from tandem.executor.piecewise_graphs import PiecewiseGraphs

            self.piecewise_graphs = PiecewiseGraphs(
                model, self.kv_cache, piecewise_graph_max_tokens, kv_spec.block_size, max_seq_len
            )

    def prepare(
        self, scheduler_output: SchedulerOutput, padded_size: int | None = None
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's inputs, built with plain ints and numpy (a decode row costs a few
        microseconds of host time), then moved to the device in one copy per dtype: the token
        inputs [3, width] (input_ids, positions, slot_mapping; the real tokens first, then
        padding up to `padded_size` or an even width: token 0, position 0, slot -1), the
        attention metadata, and the rows whose logits are sampled."""
        block_size = self.kv_spec.block_size
        requests = scheduler_output.requests
        max_blocks = max(len(r.block_ids) for r in requests)
        block_tables = np.zeros((len(requests), max_blocks), dtype=np.int32)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens, sample_rows = [0], [], []
        for row, request in enumerate(requests):
            count = len(request.token_ids)
            start = request.start_position
            block_ids = request.block_ids
            block_tables[row, : len(block_ids)] = block_ids
            input_ids.extend(request.token_ids)
            if count == 1:
                positions.append(start)
                slots.append(slot_of(block_ids, start, block_size))
            else:
                pos = np.arange(start, start + count)
                positions.extend(pos.tolist())
                table = np.asarray(block_ids, dtype=np.int64)
                slots.extend((table[pos // block_size] * block_size + pos % block_size).tolist())
            query_start_loc.append(query_start_loc[-1] + count)
            seq_lens.append(start + count)
            if request.sample:
                sample_rows.append(query_start_loc[-1] - 1)
        num_tokens = len(input_ids)
        # An even width keeps each row on a 16-byte boundary, which Triton specializes on.
        width = padded_size or num_tokens + num_tokens % 2
        padding = width - num_tokens
        token_inputs = (
            input_ids + [0] * padding,
            positions + [0] * padding,
            slots + [-1] * padding,
        )
        uploaded = self.input_staging.upload(
            {
                torch.int64: (token_inputs, sample_rows),
                torch.int32: (query_start_loc, seq_lens, block_tables),
            }
        )
        token_inputs_gpu, sample_rows_gpu = uploaded[torch.int64]
        token_inputs_gpu = token_inputs_gpu.view(3, width)
        last_tokens = [end - 1 for end in query_start_loc[1:]]
        self._take_sampled_in_flight(token_inputs_gpu[0], requests, last_tokens)
        query_start_loc_gpu, seq_lens_gpu, block_tables_gpu = uploaded[torch.int32]
        metadata = AttentionMetadata(
            slot_mapping=token_inputs_gpu[2, :num_tokens],
            query_start_loc=query_start_loc_gpu,
            seq_lens=seq_lens_gpu,
            block_tables=block_tables_gpu.view(len(requests), max_blocks),
            max_query_len=max(len(r.token_ids) for r in requests),
            max_seq_len=max(seq_lens),
        )
        return token_inputs_gpu, metadata, sample_rows_gpu

    def _take_sampled_in_flight(
        self, input_ids: torch.Tensor, requests: Sequence[ScheduledRequest], last: Iterable[int]
    ) -> None:
        """Write into input_ids (on the device), at the index of each request's last token
        (`last`), the token the step before sampled for it, where the request's last token is
        SAMPLED_IN_FLIGHT."""
        targets, sources = [], []
        for request, index in zip(requests, last, strict=True):
            if request.token_ids[-1] == SAMPLED_IN_FLIGHT:
                row = self.last_sampled_rows.get(request.request_id)
                if row is None:
                    raise RuntimeError(
                        f"request {request.request_id} takes a token the step before did not sample"
                    )
                targets.append(index)
                sources.append(row)
        if targets:
            uploaded = self.in_flight_staging.upload({torch.int64: (targets, sources)})
            targets_gpu, sources_gpu = uploaded[torch.int64]
            input_ids.index_copy_(0, targets_gpu, self.last_sampled.index_select(0, sources_gpu))

    def _graph_can_run(self, scheduler_output: SchedulerOutput) -> bool:
        """A captured graph runs decode-only batches that fit it, when no layer-wise KV save has
        to run between the layers."""
        requests = scheduler_output.requests
        return (
            self.decode_graphs is not None
            and self.decode_graphs.can_run(len(requests))
            and all(len(r.token_ids) == 1 and r.sample for r in requests)
            and not getattr(scheduler_output.kv_connector_metadata, "saves", None)
        )

    def _forward(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states of the batch's tokens and the rows that sample, from the
        piecewise graphs when the batch fits them, else from the eager forward pass."""
        connector_meta = scheduler_output.kv_connector_metadata

        def after_layer(index: int) -> None:
            self.connector.save_kv_layer(index, connector_meta)

        num_tokens = sum(len(r.token_ids) for r in scheduler_output.requests)
        graphs = self.piecewise_graphs
        padded_size = graphs.padded_size(num_tokens) if graphs is not None else None
        token_inputs, metadata, sample_rows = self.prepare(scheduler_output, padded_size)
        if padded_size is not None:
            between_layers = self.connector.saves_between_layers(connector_meta)
            hidden = graphs.run(token_inputs, metadata, num_tokens, after_layer, between_layers)
        else:
            input_ids, positions, _ = token_inputs[:, :num_tokens]
            hidden = self.model.forward(input_ids, positions, self.kv_cache, metadata, after_layer)
        return hidden, sample_rows

    def _prompt_logprobs(
        self, hidden: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """For the requests that asked for prompt logprobs: the logprobs of the prompt tokens
        this step's chunk predicts (position p predicts token p + 1), with their top-n."""
        result = {}
        row = 0
        for request in scheduler_output.requests:
            count, first = len(request.token_ids), request.start_position
            wanted = request.sampling_params.prompt_logprobs
            last = min(first + count, len(request.prompt_token_ids) - 1)
            if wanted is not None and last > first:
                targets = request.prompt_token_ids[first + 1 : last + 1]
                entries = []
                for start in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
                    part = targets[start : start + PROMPT_LOGPROBS_ROWS]
                    at = row + start
                    logits = self.model.compute_logits(hidden[at : at + len(part)])
                    entries.extend(self.sampler.logprobs_of(logits, part, wanted))
                result[request.request_id] = (first + 1, entries)
            row += count
        return result

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> Callable[[], RunnerOutput]:
        """Queue the step on the device; returns the function that waits for its output."""
        connector_meta = scheduler_output.kv_connector_metadata
        self.connector.start_load_kv(connector_meta)
        output = RunnerOutput()
        to_sample, sampled = [], None
        if scheduler_output.requests:
            if self._graph_can_run(scheduler_output):
                requests = scheduler_output.requests
                size = self.decode_graphs.load(requests)
                rows = range(len(requests))
                self._take_sampled_in_flight(self.decode_graphs.input_ids, requests, rows)
                logits = self.decode_graphs.replay(size, len(requests))
            else:
                hidden, sample_rows = self._forward(scheduler_output)
                logits = None
                if len(sample_rows):
                    logits = self.model.compute_logits(hidden[sample_rows])
                requests = scheduler_output.requests
                if any(r.sampling_params.prompt_logprobs is not None for r in requests):
                    output.prompt_logprobs = self._prompt_logprobs(hidden, scheduler_output)
            self.connector.wait_for_save(connector_meta)
            to_sample = [r for r in scheduler_output.requests if r.sample]
            if to_sample:
                sampled = self.sampler(logits, to_sample)
        if self.async_scheduling:
            self._keep_samples(to_sample, sampled)

        def wait() -> RunnerOutput:
            if sampled is not None:
                token_ids, logprobs = sampled.result()
                for request, token_id, lp in zip(to_sample, token_ids, logprobs, strict=True):
                    output.sampled_token_ids[request.request_id] = token_id
                    if lp is not None:
                        output.logprobs[request.request_id] = lp
            return output

        return wait

    def _keep_samples(self, to_sample: list[ScheduledRequest], sampled) -> None:
        """Keep the step's samples on the device for the next step (on every rank)."""
        self.last_sampled_rows = {request.request_id: row for row, request in enumerate(to_sample)}
        self.last_sampled = None
        if sampled is not None:
            self.tp.broadcast_from_first(sampled.token_ids)
            self.last_sampled = sampled.token_ids
