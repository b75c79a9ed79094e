"""How many regions the library planes (nixl, mooncake) read per prompt in steady serving, where
the engine's block pools have been reused many times, against scattered ids (one a block).

Two of the engine's own block pools (`BlockPool`, prefix caching off) stand for a prefill and a
decode worker. Requests arrive one by one: the prefill side takes the prompt's blocks at once and
frees them (last first, as the KV cache manager does) once the decode side has its copy; the
decode side takes the prompt's blocks at once, one more block every 16 generated tokens while up
to `--running` requests decode in turns, and frees all of a request's blocks when it ends. For
every prompt after the warm-up, the regions of one plane (per layer and K or V) that
`block_regions` makes (runs consecutive on both sides merged). Counts, not times: deterministic
for a seed.

    python benchmarks/block_runs.py [--requests 2000] [--running 32]
"""

from __future__ import annotations

import argparse
import random
import statistics

from tandem.engine.block_pool import BlockPool
from tandem.kv.data.registered import block_regions

BLOCK_SIZE = 16


def regions_per_plane(local_ids: list[int], remote_ids: list[int]) -> int:
    return len(block_regions(0, 1 << 20, local_ids, 0, 1 << 20, remote_ids, 1, 1))


def simulate(args: argparse.Namespace) -> dict[str, list[int]]:
    rng = random.Random(args.seed)
    prefill, decode = BlockPool(args.blocks), BlockPool(args.blocks)
    running: list[dict] = []  # each: its decode blocks, tokens so far, tokens to go
    counts: dict[str, list[int]] = {"blocks": [], "regions": []}
    for index in range(args.requests):
        prompt = rng.randint(args.min_prompt, args.max_prompt)
        num_blocks = -(-prompt // BLOCK_SIZE)
        remote = prefill.allocate(num_blocks)
        local = decode.allocate(num_blocks)
        remote_ids, local_ids = [b.block_id for b in remote], [b.block_id for b in local]
        if index >= args.warmup:
            counts["blocks"].append(num_blocks)
            counts["regions"].append(regions_per_plane(local_ids, remote_ids))
        prefill.free(reversed(remote))
        running.append({"blocks": local, "tokens": prompt, "left": args.output})
        while len(running) >= args.running:  # decode steps until one request ends
            for request in running:
                request["tokens"] += 1
                request["left"] -= 1
                if request["tokens"] > len(request["blocks"]) * BLOCK_SIZE:
                    request["blocks"] += decode.allocate(1)
            for request in [r for r in running if r["left"] == 0]:
                decode.free(reversed(request["blocks"]))
                running.remove(request)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--running", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--blocks", type=int, default=16384, help="blocks in each pool")
    parser.add_argument("--min-prompt", type=int, default=512)
    parser.add_argument("--max-prompt", type=int, default=8192)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    counts = simulate(args)
    print(f"{len(counts['blocks'])} prompts of {args.min_prompt} to {args.max_prompt} tokens, "
          f"{args.running} decoding at once, {args.output} tokens out, {args.blocks} blocks a "
          "pool")  # fmt: skip
    print("| regions per plane and prompt | median | mean | p90 |")
    print("|---|---|---|---|")
    for name in ("blocks", "regions"):
        values = sorted(counts[name])
        p90 = values[int(0.9 * (len(values) - 1))]
        label = "scattered ids (one per block)" if name == "blocks" else "the pools' blocks"
        print(f"| {label} | {statistics.median(values):.0f} | {statistics.mean(values):.1f} | "
              f"{p90} |")  # fmt: skip


if __name__ == "__main__":
    main()
