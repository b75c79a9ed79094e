"""A prompt's step run sequence-parallel (`TensorParallelGroup.split_sequence`), the model's side of
it on the CPU: at TP=2 (threads of one process, a real gloo group) each rank keeps its slice of
the tokens between the layers and the products gather or scatter the rows. The engine runs that
layout only on two ranks with peer memory on CUDA (the policy is checked here too), its products
torch's fused symmetric-memory ops (tests/test_tensor_parallel_cuda.py runs those on two GPUs);
here `GlooSplitGroup` does the same products with plain collectives (gather the rows, then
multiply; multiply, sum, keep this rank's rows), so what is tested is the layout around them:
the padding of a step whose tokens do not divide by the ranks, the QKV rows handed to attention,
biases, q/k norms, replicated KV heads, and the final gather. Two steps of one prompt (the second
attends to the first's cached KV), against TP=1 and the unsplit TP=2 forward: the final hidden
states, and the KV each rank wrote for its heads (what decode and a KV transfer read)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionMetadata, get_backend
from tandem.distributed.group import TensorParallelGroup
from tandem.models.loader import load_model
from tandem.models.source import resolve_model
from test_tensor_parallel import run_ranks

BLOCK_SIZE = 8
STEPS = (37, 27)  # a prompt's two steps; neither divides by 2
SPLIT_MIN_TOKENS = 16  # the engine's mark is 2048; steps of tiny models this size split here
SHAPES = ["llama-gqa", "qwen2-bias", "qwen3-qknorm"]  # qwen3-qknorm: its one KV head replicated


class GlooSplitGroup(TensorParallelGroup):
    """The group with the split step's products done by gloo collectives and plain products;
    `products` counts them."""

    products = 0

    def can_split_sequence(self, num_tokens: int) -> bool:
        return num_tokens >= SPLIT_MIN_TOKENS

    def all_gather_matmul(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.products += 1
        stacked = rows.new_empty(rows.shape[0] * self.size, *rows.shape[1:])
        self.process_group.allgather([list(stacked.chunk(self.size))], [rows.contiguous()]).wait()
        return F.linear(stacked, weight)

    def matmul_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.products += 1
        summed = F.linear(self.padded_rows(x), weight)
        self.process_group.allreduce([summed]).wait()
        return self.own_rows(summed)


def step_metadata(start: int, end: int, block_table: torch.Tensor) -> AttentionMetadata:
    """One sequence's tokens [start, end), the first `start` already in the cache."""
    positions = torch.arange(start, end)
    slots = block_table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=block_table[None],
        max_query_len=end - start,
        max_seq_len=end,
    )


def prompt_steps(source, tp: TensorParallelGroup, prompt: torch.Tensor, block_table: torch.Tensor):
    """The prompt's steps through this rank's model: (each step's final hidden states, the KV
    cache after them, the KV heads the rank holds, the split products it ran)."""
    model = load_model(source, get_backend("torch"), torch.float32, torch.device("cpu"), tp=tp)
    layout = model.kv_cache_layout()
    num_blocks = int(block_table.max()) + 1
    kv_cache = torch.zeros(
        layout.num_layers, 2, num_blocks, BLOCK_SIZE, layout.num_kv_heads, layout.head_dim
    )
    hidden, start = [], 0
    for length in STEPS:
        metadata = step_metadata(start, start + length, block_table)
        positions = torch.arange(start, start + length)
        hidden.append(model.forward(prompt[start : start + length], positions, kv_cache, metadata))
        start += length
    heads = range(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)
    return hidden, kv_cache, heads, getattr(model.tp, "products", 0)


def test_only_a_long_step_on_two_ranks_with_peer_memory_splits(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build
    cases = [(2, True, 2048, True), (2, True, 2047, False), (2, False, 8192, False)]
    cases += [(4, True, 8192, False)]
    for size, peer_memory, tokens, splits in cases:
        tp = TensorParallelGroup(0, size, peer_memory=object() if peer_memory else None)
        assert tp.can_split_sequence(tokens) == splits, (size, peer_memory, tokens)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_split_prompt_step_matches_tp1_and_the_unsplit_step(shape, tiny_checkpoints):
    size = 2
    source = resolve_model(str(tiny_checkpoints[shape]))
    generator = torch.Generator().manual_seed(size)
    prompt = torch.randint(0, source.config.vocab_size, (sum(STEPS),), generator=generator)
    blocks = -(-sum(STEPS) // BLOCK_SIZE)
    block_table = torch.randperm(blocks + 3, generator=generator)[:blocks].int()
    reference, reference_cache, *_ = prompt_steps(source, None, prompt, block_table)

    def ranks(split: bool):
        def work(group: TensorParallelGroup):
            tp = GlooSplitGroup(group.rank, group.size, group.process_group) if split else group
            return prompt_steps(source, tp, prompt, block_table)

        return run_ranks(size, work)

    for split, results in ((True, ranks(split=True)), (False, ranks(split=False))):
        for hidden, kv_cache, heads, products in results:
            # per layer and step: QKV and gate/up gather, output and down projections scatter
            assert products == (4 * source.config.num_layers * len(STEPS) if split else 0)
            for step, expected in zip(hidden, reference, strict=True):
                assert step.shape == expected.shape  # the step's tokens, no padding rows
                torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-4)
            own_heads = reference_cache[:, :, :, :, heads.start : heads.stop]
            torch.testing.assert_close(kv_cache, own_heads, rtol=1e-4, atol=1e-4)
