"""KV transfer through the data planes: tcp, nixl and mooncake on CPU loopback, or tcp, cuda-ipc
and nixl between two GPUs of one host, in one run.

A source process holds a KV cache of the Qwen3-0.6B shape (28 layers x 8 KV heads x head_dim 128,
bf16, 16-token blocks) and serves one prompt's blocks (default 10k tokens; block ids scattered over
a cache twice their size, almost no two consecutive, or with --blocks consecutive one run, as a
fresh cache gives) through each plane: tcp stages and streams them over its KV server; nixl
(UCX, UCX_TLS=tcp unless set) and mooncake (its tcp protocol) are read in place from the
registered cache. This process reads them into its own cache through the same plane's
start_read, the way a decode worker does, and checks the bytes once against the source. Reports
the median seconds and GB/s (1 GB = 1e9 bytes) over the repetitions, and each plane's time as a
ratio of tcp's. A plane whose library is not installed is left out.

With --device cuda the source's cache is on GPU 0 and this process's on GPU 1: nixl registers
VRAM (UCX picks its transports, cuda_ipc over NVLink where it can, unless UCX_TLS says), and the
table adds the GPU0 -> GPU1 copy ceiling (one contiguous torch copy of the same bytes) and each
plane's time as a ratio of cuda-ipc's.

    PYTHONPATH=src python benchmarks/kv_transfer_planes.py [--tokens 10000] [--repeats 5]
        [--device cuda] [--blocks consecutive]

The libraries' planes read one region per layer, key or value and run of blocks consecutive on
both sides (kv/data/registered.py): at 10k tokens 35,000 regions scattered, 56 consecutive.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from tandem.kv.data import data_plane_class, installed
from tandem.kv.data.base import BlockSource

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 8, 128, 16
DTYPE = torch.bfloat16
TRANSFER_TIMEOUT_S = 300.0

SOURCE = textwrap.dedent(
    """
    import json, sys, torch
    from tandem.kv.data import data_plane_class
    from tandem.kv.control.server import KVServer
    transport, shape, block_ids, repeats, device = sys.argv[1], json.loads(sys.argv[2]), \\
        json.loads(sys.argv[3]), int(sys.argv[4]), torch.device(sys.argv[5])
    cache = torch.empty(shape, dtype=torch.bfloat16, device=device)
    for layer in range(shape[0]):  # deterministic contents the reader recomputes
        cache[layer].copy_(torch.arange(cache[layer].numel()).view(cache[layer].shape) + layer)
    plane = data_plane_class(transport)(device, 300.0, None, lambda: None)
    plane.register_kv_cache(cache)
    server = KVServer("127.0.0.1", 0)
    if transport == "tcp":
        for index in range(repeats + 1):
            staged = plane.stage(f"t{index}", block_ids)
            for layer in range(shape[0]):
                plane.save_layer(f"t{index}", layer)
            server.publish(f"t{index}", staged.layers, staged.wait_layer)
    print("ready", json.dumps({"port": server.port, "exported": plane.export()}), flush=True)
    sys.stdin.read()
    """
)


def cache_shape(num_blocks: int) -> list[int]:
    return [LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]


def expected_cache(shape: list[int]) -> torch.Tensor:
    cache = torch.empty(shape, dtype=DTYPE)
    for layer in range(shape[0]):
        cache[layer].copy_(torch.arange(cache[layer].numel()).view(cache[layer].shape) + layer)
    return cache


def devices(args: argparse.Namespace) -> tuple[torch.device, torch.device]:
    """The source's and this process's devices."""
    if args.device == "cuda":
        return torch.device("cuda:0"), torch.device("cuda:1")
    return torch.device("cpu"), torch.device("cpu")


def bench(transport: str, args: argparse.Namespace, block_ids: list[int], shape: list[int]):
    source_device, local_device = devices(args)
    source_path = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [source_path, os.environ.get("PYTHONPATH")])),
    )
    command = [sys.executable, "-c", SOURCE, transport, json.dumps(shape)]
    command += [json.dumps(block_ids), str(args.repeats), str(source_device)]
    source = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        for line in source.stdout:
            if line.startswith("ready "):
                ready = json.loads(line.removeprefix("ready "))
                break
        else:
            raise RuntimeError(f"the {transport} source exited with {source.wait()}")
        client = None
        if transport == "tcp":
            from tandem.kv.control.client import KVClient

            client = KVClient()
        plane = data_plane_class(transport)(local_device, TRANSFER_TIMEOUT_S, client, int)
        local = torch.zeros(shape, dtype=DTYPE, device=local_device)
        plane.register_kv_cache(local)
        local_ids = list(range(len(block_ids)))
        seconds = []
        for index in range(args.repeats + 1):  # the first read connects: not timed
            source_of = BlockSource(
                "source", "127.0.0.1", ready["port"], f"t{index}", block_ids,
                f"{LAYERS}x2x{KV_HEADS}x{HEAD_DIM}:bfloat16", (0, LAYERS), (0, KV_HEADS),
                ready["exported"],
            )  # fmt: skip
            started = time.perf_counter()
            read = plane.start_read(source_of, local_ids, 0)
            plane.start_queued_reads()  # cuda-ipc launches its copy here (the engine's thread)
            num_bytes = read.result() if read.wait(TRANSFER_TIMEOUT_S) else None
            if num_bytes is None:
                raise RuntimeError(f"the {transport} read did not end")
            read.wait_copied()
            if local_device.type == "cuda":
                torch.cuda.synchronize(local_device)
            if index:
                seconds.append(time.perf_counter() - started)
        reference = expected_cache(shape)[:, :, block_ids]
        if not torch.equal(local[:, :, local_ids].cpu(), reference):
            raise RuntimeError(f"the {transport} read moved wrong bytes")
        plane.close()
        return num_bytes, seconds
    finally:
        source.stdin.close()
        source.wait(timeout=60)


def copy_ceiling(num_bytes: int, repeats: int) -> float:
    """Median seconds of one contiguous GPU0 -> GPU1 copy of num_bytes."""
    source = torch.ones(num_bytes // 2, dtype=DTYPE, device="cuda:0")
    target = torch.empty_like(source, device="cuda:1")
    seconds = []
    for index in range(repeats + 1):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize("cuda:1")
        if index:
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--blocks", choices=("scattered", "consecutive"), default="scattered")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("UCX_TLS", "tcp")
    transports = (
        ("tcp", "cuda-ipc", "nixl") if args.device == "cuda" else ("tcp", "nixl", "mooncake")
    )
    num_blocks = -(-args.tokens // BLOCK_SIZE)
    # the prompt's blocks, scattered over a cache twice their size, or the cache's first ones
    generator = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(2 * num_blocks, generator=generator)[:num_blocks].tolist()
    if args.blocks == "consecutive":
        block_ids = list(range(num_blocks))
    shape = cache_shape(2 * num_blocks)
    rows = []
    for transport in transports:
        if not installed(transport):
            print(f"{transport}: not installed, left out", file=sys.stderr)
            continue
        num_bytes, seconds = bench(transport, args, block_ids, shape)
        median = statistics.median(seconds)
        rows.append({"transport": transport, "bytes": num_bytes, "seconds": median,
                     "gb_per_s": num_bytes / median / 1e9, "samples": seconds})  # fmt: skip
    num_bytes = rows[0]["bytes"]
    base = "cuda-ipc" if args.device == "cuda" else "tcp"
    if args.device == "cuda":
        seconds = copy_ceiling(num_bytes, args.repeats)
        rows.append({"transport": "GPU0 -> GPU1 copy (ceiling)", "bytes": num_bytes,
                     "seconds": seconds, "gb_per_s": num_bytes / seconds / 1e9})  # fmt: skip
        machine = f"{torch.cuda.get_device_name(0)} x2, UCX_TLS={os.environ.get('UCX_TLS', '')}"
    else:
        machine = f"{platform.node()} ({os.cpu_count()} CPUs), UCX_TLS={os.environ['UCX_TLS']}"
    base_seconds = next(row["seconds"] for row in rows if row["transport"] == base)
    print(f"{args.tokens} tokens in {args.blocks} blocks, Qwen3-0.6B KV shape, "
          f"{num_bytes / 1e6:.0f} MB; {machine}")  # fmt: skip
    print(f"| transport | median s | GB/s | time / {base}'s |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        row[f"ratio_to_{base}"] = row["seconds"] / base_seconds
        print(f"| {row['transport']} | {row['seconds']:.4f} | {row['gb_per_s']:.2f} | "
              f"{row[f'ratio_to_{base}']:.2f} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
