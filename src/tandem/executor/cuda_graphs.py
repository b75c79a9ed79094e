"""CUDA graphs of the decode forward pass and its logits, one per batch size of a ladder.

A decode step launches a few hundred small kernels; replaying a captured graph launches them as
one. Graphs read their inputs from a static device buffer, which a step fills with one copy from
a pinned host buffer of the same layout (no per-step allocation, pinning or small copy kernels),
padding the batch up to the next captured size:

    rows  0 .. n-1        the real requests
    rows  n .. size-1     padding: token 0, slot -1 (store nothing), context length 1, block
                          table of 0s

    token inputs (int64)       [input_ids | positions | slot_mapping], max_batch each
    sequence inputs (int32)    [seq_lens (max_batch) | block_tables (max_batch x max_blocks)]
    (both in one byte buffer, the int32 part after the int64 one)

Graphs are captured with max_seq_len = the model's context length, so the attention kernels'
launch shapes cover every real context. The graph ends with the logits ([size, vocab], float32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.attention.base import AttentionMetadata
from tandem.engine.kv_cache_manager import cdiv, slot_of
from tandem.engine.outputs import ScheduledRequest
from tandem.models.base import CausalLM


def batch_size_ladder(max_batch: int) -> list[int]:
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        max_batch: int,
        max_seq_len: int,
        block_size: int,
    ) -> None:
        device = kv_cache.device
        self.model = model
        self.kv_cache = kv_cache
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.max_blocks = cdiv(max_seq_len, block_size)
        self.sizes = batch_size_ladder(max_batch)

        # One byte buffer on each side, so a step's inputs go up in one copy.
        self.token_bytes = 3 * max_batch * 8
        num_bytes = self.token_bytes + max_batch * (1 + self.max_blocks) * 4
        self.inputs = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.staging = torch.zeros(num_bytes, dtype=torch.uint8).pin_memory()
        self.token_inputs = self.inputs[: self.token_bytes].view(torch.int64)
        self.seq_inputs = self.inputs[self.token_bytes :].view(torch.int32)
        staged_tokens = self.staging[: self.token_bytes].view(torch.int64).numpy()
        staged_seqs = self.staging[self.token_bytes :].view(torch.int32).numpy()
        tokens = staged_tokens.reshape(3, max_batch)
        self.staged_ids, self.staged_positions, self.staged_slots = tokens
        self.staged_seq_lens = staged_seqs[:max_batch]
        self.staged_block_tables = staged_seqs[max_batch:].reshape(max_batch, -1)
        self.staged_slots[:] = -1
        self.staged_seq_lens[:] = 1
        self.staging_free = torch.cuda.Event()  # the last upload has left the staging buffers

        self.input_ids, self.positions, self.slot_mapping = self.token_inputs.view(3, max_batch)
        self.seq_lens = self.seq_inputs[:max_batch]
        self.block_tables = self.seq_inputs[max_batch:].view(max_batch, self.max_blocks)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._upload(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor | None] = {}
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

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model.forward(
            self.input_ids[:size], self.positions[:size], self.kv_cache, self._metadata(size)
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles kernels outside capture
            torch.cuda.synchronize(self.kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def _upload(self, size: int) -> None:
        num_bytes = self.token_bytes + (self.max_batch + size * self.max_blocks) * 4
        self.inputs[:num_bytes].copy_(self.staging[:num_bytes], non_blocking=True)
        self.staging_free.record()

    def load(self, requests: Sequence[ScheduledRequest]) -> int:
        """Put a decode-only batch (one token per request) into the graphs' inputs, row by row
        (a token SAMPLED_IN_FLIGHT left for the caller to write into `input_ids` on the
        device); returns the size of the graph that runs it."""
        num_seqs = len(requests)
        size = next(s for s in self.sizes if s >= num_seqs)
        block_size = self.block_size
        self.staging_free.synchronize()
        for row, request in enumerate(requests):
            position = request.start_position
            block_ids = request.block_ids
            self.staged_ids[row] = request.token_ids[0]
            self.staged_positions[row] = position
            self.staged_slots[row] = slot_of(block_ids, position, block_size)
            self.staged_seq_lens[row] = position + 1
            self.staged_block_tables[row, : len(block_ids)] = block_ids
        self.staged_ids[num_seqs:size] = 0  # not an earlier step's SAMPLED_IN_FLIGHT
        self.staged_slots[num_seqs:size] = -1
        self.staged_seq_lens[num_seqs:size] = 1
        self.staged_block_tables[num_seqs:size, 0] = 0
        self._upload(size)
        return size

    def replay(self, size: int, num_seqs: int) -> torch.Tensor | None:
        """Logits [num_seqs, vocab] of the batch `load` put in; None on a tensor-parallel rank
        other than the first, which only takes part."""
        self.graphs[size].replay()
        logits = self.logits[size]
        return None if logits is None else logits[:num_seqs]
