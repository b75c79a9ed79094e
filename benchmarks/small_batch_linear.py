"""One-row projections on one GPU: `small_batch_linear`'s tiles, against cuBLAS, on the
Llama-3.1-8B shape's weight shards at TP=1, 2 and 4.

For each weight [N, K] (bf16), a CUDA graph of 20 one-row products, each on the next of enough
weight copies that none is read from L2, is replayed 20 times after 3 and timed with CUDA events:
microseconds per product and the copy rate it reads the weight at. Rows: cuBLAS
(`torch.nn.functional.linear`), the kernel with its default tiles (what `small_batch_linear`
launches), and the best of a sweep over its tiles (BLOCK_N, BLOCK_K, warps, stages), each
checked against cuBLAS's product first.

    python benchmarks/small_batch_linear.py [--out F.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from gpu_suite import replay_ms  # this script's folder is on sys.path when it runs

from tandem.models.triton_ops import _small_batch_linear_kernel, small_batch_linear
from tandem.pdl import pdl_options

HIDDEN, HEADS_DIM, KV_DIM, INTERMEDIATE, VOCAB = 4096, 4096, 1024, 14336, 128256
CALLS, REPLAYS = 20, 20
L2_FREE_BYTES = 512 << 20
TILES = list(itertools.product((2, 4, 8), (256, 512, 1024, 2048), (4, 8), (1, 2, 3)))


def shard_shapes() -> dict[str, tuple[int, int]]:
    shapes = {}
    for size in (1, 2, 4):
        shapes[f"tp{size} qkv"] = ((HEADS_DIM + 2 * KV_DIM) // size, HIDDEN)
        shapes[f"tp{size} o"] = (HIDDEN, HEADS_DIM // size)
        shapes[f"tp{size} gate_up"] = (2 * INTERMEDIATE // size, HIDDEN)
        shapes[f"tp{size} down"] = (HIDDEN, INTERMEDIATE // size)
    shapes["tp2 lm_head"] = (VOCAB // 2, HIDDEN)
    return shapes


def launch_with(tile):
    block_n, block_k, warps, stages = tile

    def launch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
        _small_batch_linear_kernel[(triton.cdiv(n, block_n),)](
            x, weight, weight, out, 1, n, k, x.stride(0), out.stride(0), ROWS=1,
            BLOCK_N=block_n, BLOCK_K=block_k, EVEN=n % block_n == 0 and k % block_k == 0,
            HAS_BIAS=False, **pdl_options(x.device), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return launch


def graph_us(product, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(CALLS):
            product(x, weights[call % len(weights)])
    return replay_ms(graph, 3, REPLAYS) * 1000 / CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    print(
        f"{'weight [N, K]':24} {'cuBLAS us':>10} {'default us':>11} {'best us':>8}  best tile "
        "(BLOCK_N, BLOCK_K, warps, stages)  GB/s cuBLAS / default / best"
    )
    for name, (n, k) in shard_shapes().items():
        nbytes = n * k * 2
        copies = max(2, -(-L2_FREE_BYTES // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        expected = torch.nn.functional.linear(x, weights[0]).float()
        timings = {"cublas": graph_us(torch.nn.functional.linear, x, weights)}
        timings["default"] = graph_us(small_batch_linear, x, weights)
        for tile in TILES:
            if tile[1] > k:
                continue
            launch = launch_with(tile)
            got = launch(x, weights[0]).float()
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
            timings[tile] = graph_us(launch, x, weights)
        best = min((t for t in timings if isinstance(t, tuple)), key=timings.get)
        rate = [nbytes / timings[key] / 1e3 for key in ("cublas", "default", best)]
        print(
            f"{name + f' [{n}, {k}]':24} {timings['cublas']:10.1f} {timings['default']:11.1f} "
            f"{timings[best]:8.1f}  {str(best):38} {rate[0]:.0f} / {rate[1]:.0f} / {rate[2]:.0f}"
        )
        results[name] = {"shape": [n, k], "cublas_us": timings["cublas"],
                         "default_us": timings["default"], "best_tile": list(best),
                         "best_us": timings[best]}  # fmt: skip
        del weights
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
