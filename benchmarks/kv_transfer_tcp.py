"""KV transfer over TCP: KVServer/KVClient throughput against one raw TCP stream.

Moves a whole prompt's KV (default: 10k tokens of the SmolLM2-135M shape, 30 layers x 3 KV heads x
head_dim 64, in 16-token blocks) as per-layer staging tensors [2, blocks, 16, kv_heads, head_dim]
through the transport on loopback, and the same number of bytes through one raw TCP stream
(`sendall` of one buffer, `recv_into` one buffer, same socket options) in the same process and run,
alternating the two. Reports the median GB/s (1 GB = 1e9 bytes) of each with its range over the
repetitions, and the ratio of the medians.

    python benchmarks/kv_transfer_tcp.py [--tokens 10000] [--repeats 7] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import torch

from tandem.kv.control.client import KVClient
from tandem.kv.control.server import KVServer
from tandem.kv.control.wire import SOCKET_BUFFER_BYTES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Result:
    dtype: str
    num_tokens: int
    num_bytes: int
    bytes_per_token: int
    transport_gbps: list[float]
    raw_gbps: list[float]

    @property
    def transport_median(self) -> float:
        return statistics.median(self.transport_gbps)

    @property
    def raw_median(self) -> float:
        return statistics.median(self.raw_gbps)


class RawStream:
    """One loopback TCP connection; each `transfer` asks for and receives `len(source)` bytes."""

    def __init__(self, source: memoryview) -> None:
        self._source = source
        listener = socket.create_server(("127.0.0.1", 0))
        self._configure(listener)
        self._sender_thread = threading.Thread(target=self._serve, args=(listener,), daemon=True)
        self._sender_thread.start()
        self._sock = socket.socket()
        self._configure(self._sock)
        self._sock.connect(listener.getsockname())

    @staticmethod
    def _configure(sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _serve(self, listener: socket.socket) -> None:
        connection, _ = listener.accept()
        listener.close()
        self._configure(connection)
        with connection:
            while connection.recv(1) == b"g":
                connection.sendall(self._source)

    def transfer(self, dest: memoryview) -> None:
        self._sock.sendall(b"g")
        received = 0
        while received < len(dest):
            count = self._sock.recv_into(dest[received:], len(dest) - received)
            if count == 0:
                raise ConnectionError("raw sender closed early")
            received += count

    def close(self) -> None:
        self._sock.close()
        self._sender_thread.join(timeout=5.0)


def make_layers(args: argparse.Namespace, dtype: torch.dtype) -> list[torch.Tensor]:
    num_blocks = -(-args.tokens // args.block_size)
    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(args.layers)]


def byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def bench_dtype(args: argparse.Namespace, dtype_name: str) -> Result:
    source = make_layers(args, DTYPES[dtype_name])
    dest = [torch.zeros_like(layer) for layer in source]
    num_bytes = sum(layer.numel() * layer.element_size() for layer in source)
    raw_source = torch.ones(num_bytes, dtype=torch.uint8)
    raw_dest = torch.zeros(num_bytes, dtype=torch.uint8)

    server = KVServer("127.0.0.1", 0)
    client = KVClient()
    raw = RawStream(byte_view(raw_source))
    transport_gbps: list[float] = []
    raw_gbps: list[float] = []
    try:
        for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
            transfer_id = f"bench-{dtype_name}-{repeat}"
            server.publish(transfer_id, source)

            def run_transport(transfer_id: str = transfer_id) -> None:
                client.fetch("127.0.0.1", server.port, transfer_id, dest, timeout=120.0)

            def run_raw() -> None:
                raw.transfer(byte_view(raw_dest))

            # The order alternates so that neither path always runs right after the other.
            order = [run_transport, run_raw] if repeat % 2 == 0 else [run_raw, run_transport]
            seconds = {}
            for run in order:
                started = time.perf_counter()
                run()
                seconds[run] = time.perf_counter() - started
            if repeat > 0:
                transport_gbps.append(num_bytes / seconds[run_transport] / 1e9)
                raw_gbps.append(num_bytes / seconds[run_raw] / 1e9)
        if not all(torch.equal(got, want) for got, want in zip(dest, source, strict=True)):
            raise AssertionError("the transport delivered different bytes")
    finally:
        raw.close()
        client.close()
        server.close()
    return Result(
        dtype=dtype_name,
        num_tokens=args.tokens,
        num_bytes=num_bytes,
        bytes_per_token=num_bytes // args.tokens,
        transport_gbps=transport_gbps,
        raw_gbps=raw_gbps,
    )


def spread(samples: list[float]) -> str:
    """'median (min-max)' of GB/s samples."""
    return f"{statistics.median(samples):.2f} ({min(samples):.2f}-{max(samples):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args()

    results = [bench_dtype(args, name) for name in args.dtypes.split(",")]

    print(f"KV transfer over TCP, loopback, {args.tokens} tokens, median of {args.repeats}")
    print(
        "| dtype | bytes/token | MB moved | KVServer/Client GB/s | raw TCP stream GB/s "
        "| ratio of medians |"
    )
    print("|---|---|---|---|---|---|")
    for result in results:
        print(
            f"| {result.dtype} | {result.bytes_per_token:,} | {result.num_bytes / 1e6:.1f} "
            f"| {spread(result.transport_gbps)} | {spread(result.raw_gbps)} "
            f"| {result.transport_median / result.raw_median:.2f} |"
        )
    if args.out:
        report = {
            "benchmark": "kv_transfer_tcp",
            "config": vars(args),
            "machine": {
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "load_average_1_5_15_min": os.getloadavg(),
            },
            "results": [
                {
                    **asdict(result),
                    "transport_gbps_median": result.transport_median,
                    "raw_gbps_median": result.raw_median,
                    "ratio": result.transport_median / result.raw_median,
                }
                for result in results
            ],
        }
        with open(args.out, "w") as out_file:
            json.dump(report, out_file, indent=2)


if __name__ == "__main__":
    main()
