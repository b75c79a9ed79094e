"""The host time of queuing one cuda-ipc block copy (`BlockCopier.launch`) and of its parts,
in a process of its own: the whole launch (behind another event, as an early handoff's, and
without), the two timing events, the block ids' upload, the Triton kernel's launch. The caches
are local (the launch's host work does not depend on where the remote one lives); each time is
the mean over 200 calls, the GPU left to drain after each series.

    python benchmarks/copy_launch.py [--device cuda:1] [--blocks 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tandem.kv.data.cuda_ipc import BlockCopier, copy_blocks_kernel

CACHE_SHAPE = (28, 2, 4096, 16, 8, 128)  # Qwen3-0.6B's layers, KV heads and head size
CALLS = 200


def mean_microseconds(function: Callable[[], object], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(CALLS):
        function()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return elapsed / CALLS * 1e6


def warmed_copier(
    device: torch.device, block_ids: list[int]
) -> tuple[BlockCopier, torch.Tensor, torch.Tensor, torch.cuda.Event]:
    """A copier into a local cache on `device` and a second cache there as the remote one,
    with the kernel compiled and the pinned buffer filled by copies of `block_ids` behind an
    event: (copier, local cache, remote cache, that event)."""
    local = torch.zeros(CACHE_SHAPE, dtype=torch.bfloat16, device=device)
    remote = torch.zeros(CACHE_SHAPE, dtype=torch.bfloat16, device=device)
    copier = BlockCopier(local)
    after = torch.cuda.Event()
    after.record()
    for _ in range(20):
        copier.launch(remote, block_ids, block_ids, after=after)
    return copier, local, remote, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:1" if torch.cuda.device_count() > 1 else "cuda")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per copy (128 tokens)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    block_ids = list(range(args.blocks))
    copier, local, remote, after = warmed_copier(device, block_ids)
    remote_ids, local_ids = copier.id_staging.upload({torch.int32: (block_ids, block_ids)})[
        torch.int32
    ]
    parts = {
        "launch, behind an event": lambda: copier.launch(remote, block_ids, block_ids, after=after),
        "launch": lambda: copier.launch(remote, block_ids, block_ids),
        "two timing events": lambda: (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        ),
        "block ids' upload": lambda: copier.id_staging.upload(
            {torch.int32: (block_ids, block_ids)}
        ),
        "Triton kernel launch": lambda: copy_blocks_kernel(remote, remote_ids, local, local_ids),
    }
    print(f"{torch.cuda.get_device_name(device)}, {args.blocks} blocks, mean of {CALLS} calls")
    print("| part | µs |\n|---|---|")
    for name, function in parts.items():
        print(f"| {name} | {mean_microseconds(function, device):.1f} |")


if __name__ == "__main__":
    main()
