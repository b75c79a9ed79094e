"""CUDA graphs of the decode forward pass, one per batch size of a ladder.

A decode step launches a few hundred small kernels; replaying a captured graph launches them as
one. Graphs read their inputs from static buffers, so a step copies its inputs in, pads the batch
up to the next captured size and replays:

    rows  0 .. n-1        the real requests
    rows  n .. size-1     padding: slot -1 (store nothing), context length 1, block table of 0s

Graphs are captured with max_seq_len = the model's context length, so the attention kernels'
launch shapes cover every real context.
"""

from __future__ import annotations

import torch

from tandem.attention.base import AttentionMetadata
from tandem.engine.kv_cache_manager import cdiv
from tandem.models.llama import LlamaForCausalLM


def batch_size_ladder(max_batch: int) -> list[int]:
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        max_batch: int,
        max_seq_len: int,
        block_size: int,
    ) -> None:
        device = kv_cache.device
        self.model = model
        self.kv_cache = kv_cache
        self.max_seq_len = max_seq_len
        self.sizes = batch_size_ladder(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (max_batch, cdiv(max_seq_len, block_size)), dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):
            args = (self.input_ids[:size], self.positions[:size], self.kv_cache)
            self.model(*args, self._metadata(size))  # warm-up: compiles kernels outside capture
            torch.cuda.synchronize(self.kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args, self._metadata(size))
            pool = graph.pool()
            self.graphs[size] = graph

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_seqs = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self.seq_lens[num_seqs:size].fill_(1)
        width = metadata.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        self.block_tables[num_seqs:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
