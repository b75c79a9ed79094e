"""Attention on the paged KV cache: the Triton backend against the torch backend, one CUDA GPU.

One attention layer of a real model shape (default Llama-3.1-8B: 32 heads / 8 kv heads,
head_dim 128; bf16 cache, 16-token blocks, block ids shuffled):

    decode   batch 1 and 64, every context 1024 and 8192 tokens
             GB/s = KV bytes read (sum of contexts x kv_heads x head_dim x 2 x 2 bytes) / time
    prefill  8192 new tokens, with no cached prefix and after a 4096-token prefix
             TFLOP/s = 4 x heads x head_dim x causal (query, key) pairs / time

Each time is the median of 5 rounds; a round is CUDA events around `--repeats` back-to-back forward
calls (store + attention), after warm-up calls. Decode rounds rotate among copies of the batch in
disjoint blocks, at least 256 MB in all, so the 50 MB L2 cache cannot serve them. The Triton
backend is timed twice: eager (Python launch overhead included) and replayed from one CUDA graph
(GPU time alone); the torch backend synchronises with the host, so it runs eager only.
`--sweep` also times a few tile configurations of the Triton backend.

    PYTHONPATH=src python benchmarks/attention_triton.py [--shape qwen3-0.6b] [--sweep] \
        [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

SHAPES = {  # heads, kv heads, head_dim
    "llama-3.1-8b": (32, 8, 128),
    "qwen3-0.6b": (16, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
BLOCK_SIZE = 16
ROTATION_BYTES = 256 * 2**20
# Defaults for 16-bit caches, head_dim <= 128: prefill m128 n128 w8 s2; decode n64 w4 s3,
# >= 128 keys per split, 2 programs per multiprocessor.
SWEEP_CONFIGS = {
    "prefill m128 n64 w8 s2": TritonAttentionConfig(128, 64, 8, 2),
    "prefill m128 n128 w8 s3": TritonAttentionConfig(128, 128, 8, 3),
    "prefill m128 n128 w4 s2": TritonAttentionConfig(128, 128, 4, 2),
    "prefill m64 n128 w4 s2": TritonAttentionConfig(64, 128, 4, 2),
    "decode n32 w4 s3": TritonAttentionConfig(decode_block_n=32),
    "decode n128 w8 s3": TritonAttentionConfig(decode_block_n=128, decode_num_warps=8),
    "decode >= 256 keys/split": TritonAttentionConfig(decode_min_keys_per_split=256),
    "decode 4 programs/SM": TritonAttentionConfig(decode_programs_per_sm=4),
}


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    metadata: AttentionMetadata


def make_batches(
    cached: list[int], new: list[int], num_kv_heads: int, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, list[Batch]]:
    """A cache and enough copies of the batch (each in its own blocks) to fill ROTATION_BYTES."""
    seq_lens = [c + n for c, n in zip(cached, new, strict=True)]
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    bytes_per_copy = sum(blocks_per_seq) * BLOCK_SIZE * num_kv_heads * head_dim * 2 * 2
    num_copies = max(1, -(-ROTATION_BYTES // bytes_per_copy))
    num_blocks = 1 + num_copies * sum(blocks_per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16)
    free_block_ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    num_tokens = sum(new)
    batches = []
    for _ in range(num_copies):
        tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
        slots, query_start_loc = [], [0]
        for seq, (c, n) in enumerate(zip(cached, new, strict=True)):
            block_ids = torch.tensor([free_block_ids.pop() for _ in range(blocks_per_seq[seq])])
            tables[seq, : len(block_ids)] = block_ids
            positions = torch.arange(c, c + n)
            slots.append(block_ids[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE)
            query_start_loc.append(query_start_loc[-1] + n)
        metadata = AttentionMetadata(
            slot_mapping=torch.cat(slots).cuda(),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
            block_tables=tables.cuda(),
            max_query_len=max(new),
            max_seq_len=max(seq_lens),
        )
        q, k, v = (
            torch.randn(num_tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
            for heads in (num_heads, num_kv_heads, num_kv_heads)
        )
        batches.append(Batch(q, k, v, metadata))
    return k_cache, v_cache, batches


def time_ms(run_round: Callable[[], None], calls_per_round: int, rounds: int = 5) -> float:
    """Median over rounds of (CUDA-event time of one round) / calls_per_round."""
    run_round()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_round()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_round)
    return statistics.median(times)


def time_backend(
    backend: AttentionBackend, k_cache, v_cache, batches: list[Batch], repeats: int, graph: bool
) -> float:
    scale = batches[0].q.shape[-1] ** -0.5
    calls = [batches[i % len(batches)] for i in range(max(repeats, len(batches)))]

    def eager_round() -> None:
        for b in calls:
            backend.forward(b.q, b.k, b.v, k_cache, v_cache, b.metadata, scale)

    eager_round()  # compiles the kernels before any capture
    if not graph:
        return time_ms(eager_round, len(calls))
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        eager_round()
    return time_ms(cuda_graph.replay, len(calls))


def bench_case(name: str, cached: list[int], new: list[int], shape: tuple, args) -> dict:
    num_heads, num_kv_heads, head_dim = shape
    k_cache, v_cache, batches = make_batches(cached, new, num_kv_heads, num_heads, head_dim)
    decode = max(new) == 1
    repeats = args.repeats if decode else max(3, args.repeats // 10)
    kv_bytes = sum(c + n for c, n in zip(cached, new, strict=True)) * num_kv_heads * head_dim * 4
    causal_pairs = sum(n * c + n * (n + 1) // 2 for c, n in zip(cached, new, strict=True))
    flops = 4 * num_heads * head_dim * causal_pairs

    def rate(ms: float) -> float:
        return kv_bytes / ms / 1e6 if decode else flops / ms / 1e9  # GB/s or TFLOP/s

    runs = [
        ("triton graph", TritonAttentionBackend(), repeats, True),
        ("triton eager", TritonAttentionBackend(), repeats, False),
        ("torch eager", TorchAttentionBackend(), 3, False),
    ]
    if args.sweep:
        runs += [
            (f"triton graph, {label}", TritonAttentionBackend(config), repeats, True)
            for label, config in SWEEP_CONFIGS.items()
            if label.startswith("decode") == decode
        ]
    timings = {
        label: time_backend(backend, k_cache, v_cache, batches, calls, graph)
        for label, backend, calls, graph in runs
    }
    del k_cache, v_cache, batches
    torch.cuda.empty_cache()
    return {
        "case": name,
        "unit": "GB/s" if decode else "TFLOP/s",
        "results": {label: {"ms": ms, "rate": rate(ms)} for label, ms in timings.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    parser.add_argument("--repeats", type=int, default=50, help="forward calls per timed round")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    cases = [
        (f"decode b{batch} ctx{context}", [context - 1] * batch, [1] * batch)
        for batch in (1, 64)
        for context in (1024, 8192)
    ]
    cases += [("prefill 8192", [0], [8192]), ("prefill 8192 after 4096", [4096], [8192])]
    report = [bench_case(name, cached, new, shape, args) for name, cached, new in cases]

    device = torch.cuda.get_device_name()
    print(f"\n{device}, shape {args.shape} {shape}, bf16 cache, block {BLOCK_SIZE}")
    print(f"{'case':<24} {'backend':<42} {'us':>9} {'rate':>14}")
    for entry in report:
        for label, result in entry["results"].items():
            rate = f"{result['rate']:.1f} {entry['unit']}"
            print(f"{entry['case']:<24} {label:<42} {result['ms'] * 1e3:9.1f} {rate:>14}")
    if args.out:
        with open(args.out, "w") as out_file:
            json.dump({"device": device, "shape": args.shape, "cases": report}, out_file, indent=2)


if __name__ == "__main__":
    main()
