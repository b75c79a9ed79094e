"""MLA's absorbed decode attention: the Triton kernel on the paged cache against the torch path.

One layer of DeepSeek-V2-Lite's attention (16 heads, latent 512 + rope 64, bf16 cache of
16-token blocks, block ids shuffled), a decode batch of 1 and 64 sequences with every context
1024 and 4096 tokens:

    torch    `latent_attention` over `gather_latents` (a padded copy of every context, then
             SDPA); it synchronises with the host, so it runs eager only
    triton   `mla_decode` (reads the latents in place), eager and replayed from a CUDA graph
    bound    the latents of the batch read once (sum of contexts x 576 x 2 bytes) over the
             rate of a device-to-device copy of 1 GiB (bytes read + written / time)

Each time is the median of 5 rounds; a round is CUDA events around `--repeats` calls, after a
warm-up. Rounds rotate among copies of the batch in disjoint blocks, at least 256 MB in all, so
the L2 cache cannot serve them. Every case first checks the kernel against the torch path.

    PYTHONPATH=src python benchmarks/mla_decode.py [--repeats 50] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
from attention_triton import time_ms  # this script's folder is on sys.path when it runs

from tandem.attention.base import AttentionMetadata

HEADS, LATENT, ROPE = 16, 512, 64
WIDTH = LATENT + ROPE
BLOCK_SIZE = 16
ROTATION_BYTES = 256 * 2**20
CASES = [(1, 1024), (1, 4096), (64, 1024), (64, 4096)]  # (batch, context)
SCALE = 192**-0.5


def make_batches(
    batch: int, context: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, AttentionMetadata]]]:
    """A one-layer cache [2, blocks, BLOCK_SIZE, 1, WIDTH / 2] and copies of the batch (queries,
    metadata), each in its own shuffled blocks, enough to fill ROTATION_BYTES."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    bytes_per_copy = batch * blocks_per_seq * BLOCK_SIZE * WIDTH * dtype.itemsize
    num_copies = max(1, -(-ROTATION_BYTES // bytes_per_copy))
    num_blocks = num_copies * batch * blocks_per_seq
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, 1, WIDTH // 2, device=device, dtype=dtype)
    block_ids = torch.randperm(num_blocks, dtype=torch.int32).view(num_copies, batch, -1)
    copies = []
    for tables in block_ids:
        metadata = AttentionMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            max_query_len=1,
            max_seq_len=context,
        )
        q = torch.randn(batch, HEADS, WIDTH, device=device, dtype=dtype)
        copies.append((q, metadata))
    return cache, copies


def copy_rate_gbps() -> float:
    """Device-to-device copy of 1 GiB: (bytes read + bytes written) / time, in GB/s."""
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = time_ms(lambda: [target.copy_(source) for _ in range(5)], 5)
    return 2 * source.numel() / ms / 1e6


def bench_case(batch: int, context: int, repeats: int, copy_gbps: float) -> dict:
    from tandem.attention.triton_mla import mla_decode, num_splits
    from tandem.models.layers.mla import gather_latents, latent_attention

    cache, copies = make_batches(batch, context, "cuda", torch.bfloat16)
    calls = [copies[i % len(copies)] for i in range(max(repeats, len(copies)))]

    def torch_path(q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        latents = gather_latents(cache, metadata)
        return latent_attention(q, latents, metadata, SCALE, LATENT)

    def kernel(q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return mla_decode(q, cache, metadata, SCALE, LATENT)

    q, metadata = copies[0]
    expected = latent_attention(q.float(), gather_latents(cache.float(), metadata), metadata,
                                SCALE, LATENT)  # fmt: skip
    torch.testing.assert_close(kernel(q, metadata).float(), expected, atol=2e-2, rtol=2e-2)

    def rounds_of(path: Callable) -> Callable[[], None]:
        return lambda: [path(q, metadata) for q, metadata in calls]

    torch_ms = time_ms(rounds_of(torch_path), len(calls))
    eager_ms = time_ms(rounds_of(kernel), len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rounds_of(kernel)()
    graph_ms = time_ms(graph.replay, len(calls))
    latent_bytes = batch * context * WIDTH * cache.element_size()
    bound_ms = latent_bytes / copy_gbps / 1e6
    return dict(batch=batch, context=context, splits=num_splits(metadata, HEADS, q.device),
                latent_mb=latent_bytes / 1e6, torch_ms=torch_ms, triton_eager_ms=eager_ms,
                triton_graph_ms=graph_ms, bound_ms=bound_ms)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="calls per timed round")
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU; run it on a machine with one")
    copy_gbps = copy_rate_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbps:.0f} GB/s (read + write)")
    header = ("batch", "context", "splits", "latents MB", "torch ms", "triton ms", "graph ms",
              "bound ms", "speed-up", "of bound")  # fmt: skip
    print(" | ".join(header))
    rows = []
    for batch, context in CASES:
        row = bench_case(batch, context, args.repeats, copy_gbps)
        rows.append(row)
        print(
            f"{batch} | {context} | {row['splits']} | {row['latent_mb']:.1f} | "
            f"{row['torch_ms']:.3f} | {row['triton_eager_ms']:.3f} | {row['triton_graph_ms']:.3f}"
            f" | {row['bound_ms']:.3f} | {row['torch_ms'] / row['triton_graph_ms']:.1f}x | "
            f"{row['bound_ms'] / row['triton_graph_ms']:.0%}"
        )
    if args.out:
        with open(args.out, "w") as file:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=copy_gbps, rows=rows),
                      file, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
