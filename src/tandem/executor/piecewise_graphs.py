"""Piecewise CUDA graphs of the forward pass for batches of up to `max_tokens` tokens (prompts,
prefill chunks, mixed batches), one set of pieces per size of a ladder (docs/architecture.md,
"One engine step"; the numbers are in docs/benchmarks.md).

A small model's eager pass is bound by the host's kernel launches. All of a layer but its
attention depends on the token count alone, so that part is captured for a padded count; the
attention, whose launch shape depends on the batch's sequences, runs eagerly between the pieces
over the real tokens:

    piece 0        embedding, layer 0's input norm and attention inputs (q/k/v projection,
                   norms, rotary, K/V store)
    attention 0    eager
    piece i        layer i-1's output projection, MLP and residual adds; layer i's attention
                   inputs ...
    piece L        the last layer's output and the final norm

The pieces read the token inputs from a static buffer (padding rows: token 0, position 0, slot
-1, which stores nothing) and pass the residual stream, queries and attention output through
static buffers, so all sizes share one memory pool: a size's pieces replay in capture order,
never interleaved with another size's. Needs the fused kernels. A batch of one sequence replays
one whole-pass graph of its size instead (its metadata fits static buffers too), the connector's
per-layer calls after it unless they overlap the pass (TCP's copies out). Sizes whose graphs do
not save a tenth of the eager time (timed once captured) run eagerly, as do larger batches."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tandem.attention.base import AttentionMetadata
from tandem.engine.kv_cache_manager import cdiv
from tandem.models.base import CausalLM

logger = logging.getLogger(__name__)
KEEP_BELOW = 0.9  # a size is kept when its graphs take at most this share of the eager time
TIMING_REPEATS = 3


def token_count_ladder(max_tokens: int) -> list[int]:
    """Padded token counts: powers of two from 16 to 256, then steps of 256, up to max_tokens
    rounded down to a multiple of 16 (empty below 16). Multiples of 16 keep every row of the
    static token buffer on a 16-byte boundary, the alignment Triton specializes kernels on."""
    top = max_tokens // 16 * 16
    sizes = [size for size in (16, 32, 64, 128, 256) if size <= top]
    sizes += list(range(512, top + 1, 256))
    if sizes and sizes[-1] != top:
        sizes.append(top)
    return sizes


class PiecewiseGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        max_tokens: int,
        block_size: int,
        max_seq_len: int,
    ) -> None:
        if not model.fused_ops:
            raise ValueError("piecewise CUDA graphs need the model's fused kernels")
        ladder = token_count_ladder(max_tokens)
        if not ladder:
            raise ValueError("piecewise CUDA graphs need a batch of at least 16 tokens")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        capacity = ladder[-1]
        self.num_layers = model.config.num_layers
        config, device = model.config, kv_cache.device
        dtype = model.dtype
        # [input_ids | positions | slot_mapping], one row each
        self.token_inputs = torch.zeros(3, capacity, dtype=torch.int64, device=device)
        self.token_inputs[2] = -1
        self.residual = torch.zeros(capacity, config.hidden_size, dtype=dtype, device=device)
        heads = (config.num_heads, config.head_dim)
        self.queries = torch.zeros(capacity, *heads, dtype=dtype, device=device)
        self.attended = torch.zeros(capacity, *heads, dtype=dtype, device=device)
        self.hidden = torch.zeros(capacity, config.hidden_size, dtype=dtype, device=device)
        # one sequence's metadata, for the whole-pass graphs (a backend that never syncs)
        self.max_seq_len = max_seq_len
        self.whole_pass = model.backend.capturable
        self.one_query_start_loc = torch.zeros(2, dtype=torch.int32, device=device)
        self.one_seq_len = torch.zeros(1, dtype=torch.int32, device=device)
        self.one_block_table = torch.zeros(
            1, cdiv(max_seq_len, block_size), dtype=torch.int32, device=device
        )
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.whole_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(ladder)
        self.sizes = sorted(self.graphs)
        logger.info(
            "piecewise CUDA graphs for batches of up to %d tokens (larger ones eager)",
            self.sizes[-1] if self.sizes else 0,
        )

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured size a batch of num_tokens runs at; None when it is too large (or no
        size paid for its graphs)."""
        return next((size for size in self.sizes if size >= num_tokens), None)

    def _pieces(self, size: int) -> list[Callable[[], None]]:
        model, kv_cache, num_layers = self.model, self.kv_cache, self.num_layers
        input_ids, positions, slot_mapping = self.token_inputs[:, :size]
        context = model.forward_context(positions, slot_mapping)
        residual = self.residual[:size]
        attended = self.attended[:size].view(size, -1)

        def store_queries(index: int, hidden: torch.Tensor) -> None:
            (queries,) = model.attention_inputs(index, hidden, kv_cache, context)
            self.queries[:size].copy_(queries)

        def first() -> None:
            hidden, embedded = model.embed(input_ids)
            residual.copy_(embedded)
            store_queries(0, hidden)

        def after_attention(index: int) -> Callable[[], None]:
            def piece() -> None:
                hidden, _ = model.layer_output(index, attended, residual)  # residual in place
                if index + 1 < num_layers:
                    store_queries(index + 1, hidden)
                else:
                    self.hidden[:size].copy_(hidden)

            return piece

        return [first, *(after_attention(index) for index in range(num_layers))]

    def _whole_pass(self, size: int, pieces: list[Callable[[], None]]) -> Callable[[], None]:
        """The pieces of `size` with the attention between them, over the one-sequence
        metadata buffers."""
        metadata = AttentionMetadata(
            slot_mapping=self.token_inputs[2, :size],
            query_start_loc=self.one_query_start_loc,
            seq_lens=self.one_seq_len,
            block_tables=self.one_block_table,
            max_query_len=size,
            max_seq_len=self.max_seq_len,
        )
        queries, attended = self.queries[:size], self.attended[:size]

        def whole_pass() -> None:
            for index in range(self.num_layers):
                pieces[index]()
                self.model.attention(index, (queries,), self.kv_cache, metadata, out=attended)
            pieces[-1]()

        return whole_pass

    @torch.inference_mode()
    def _capture(self, ladder: list[int]) -> None:
        pool = None
        timing = True  # until a size pays, the sizes below it being more bound by the host
        for size in reversed(ladder):
            pieces = self._pieces(size)
            for piece in pieces:  # warm-up: compiles kernels outside capture
                piece()
            torch.cuda.synchronize(self.kv_cache.device)
            graphs = []
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    piece()
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[size] = graphs
            if timing:
                graphed, eager = self._time_against_eager(size)
                if graphed > KEEP_BELOW * eager:
                    # nothing kept yet: the next size starts a pool of its own, this one's freed
                    del self.graphs[size], graphs, graph
                    pool = None
                    continue
                timing = False
            if self.whole_pass:
                whole_pass = self._whole_pass(size, pieces)
                whole_pass()  # warm-up: the attention's launch for this size (no query: a no-op)
                torch.cuda.synchronize(self.kv_cache.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    whole_pass()
                self.whole_graphs[size] = graph

    def _time_against_eager(self, size: int) -> tuple[float, float]:
        """Seconds of a batch of one sequence of `size` new tokens (storing nothing) in the
        graphs and in the eager pass, each the fastest of a few runs."""
        device = self.kv_cache.device
        token_inputs = torch.zeros(3, size, dtype=torch.int64, device=device)
        token_inputs[2] = -1
        token_inputs[1] = torch.arange(size, device=device)
        block_table = torch.zeros(cdiv(size, self.block_size), dtype=torch.int32, device=device)
        metadata = AttentionMetadata.one_prompt(token_inputs[2], block_table)

        def fastest(forward: Callable[[], torch.Tensor]) -> float:
            times = []
            for _ in range(1 + TIMING_REPEATS):
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                forward()
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            return min(times[1:])

        graphed = fastest(lambda: self.run(token_inputs, metadata, size))
        eager = fastest(
            lambda: self.model.forward(token_inputs[0], token_inputs[1], self.kv_cache, metadata)
        )
        return graphed, eager

    def run(
        self,
        token_inputs: torch.Tensor,  # [3, padded size]: input_ids, positions, slot_mapping
        metadata: AttentionMetadata,
        num_tokens: int,
        after_layer: Callable[[int], None] | None = None,
        between_layers: bool = False,
    ) -> torch.Tensor:
        """The final hidden states [num_tokens, hidden] of the batch; after_layer(i) runs once
        layer i's K/V is in the cache (queued), right after that layer when between_layers,
        else possibly once the whole pass is queued."""
        size = token_inputs.shape[1]
        self.token_inputs[:, :size].copy_(token_inputs)
        whole_graph = self.whole_graphs.get(size)
        if whole_graph is not None and metadata.num_seqs == 1 and not between_layers:
            self.one_query_start_loc.copy_(metadata.query_start_loc)
            self.one_seq_len.copy_(metadata.seq_lens)
            self.one_block_table[:, : metadata.block_tables.shape[1]].copy_(metadata.block_tables)
            whole_graph.replay()
            if after_layer is not None:
                for index in range(self.num_layers):
                    after_layer(index)
            return self.hidden[:num_tokens]
        queries, attended = self.queries[:num_tokens], self.attended[:num_tokens]
        graphs = self.graphs[size]
        for index in range(self.num_layers):
            graphs[index].replay()
            self.model.attention(index, (queries,), self.kv_cache, metadata, out=attended)
            if after_layer is not None:
                after_layer(index)
        graphs[-1].replay()
        return self.hidden[:num_tokens]
