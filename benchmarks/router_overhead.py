"""Router overhead: the TTFT that `tandem router` and `vllm-router` add in front of one set of PD
workers, measured in one run against the same workers.

For each concurrency, the same streaming completions (distinct prompts, so no prefix-cache hits;
`ignore_eos`, fixed `max_tokens`) go through each path in turn:

* direct: this client runs the two PD legs itself (prefill leg, then the decode stream), as a
  router that costs nothing would. Its TTFT is the prefill answer's arrival (the first token is
  known then); its "decode TTFT" is the decode stream's first token, the earliest a router that
  only relays the decode leg (like vllm-router) can deliver one.
* tandem: `tandem router` started here in front of the workers.
* vllm-router: `vllm-router --vllm-pd-disaggregation` started here, when its binary is found.

It prints one table (TTFT p50/p99, TTFT added over direct at p50/p99, end-to-end p50, requests/s)
and can write the samples' summary as JSON.

    python benchmarks/router_overhead.py --prefill URL --decode URL [--concurrency 1 64 256]
    python benchmarks/router_overhead.py --fake-workers    # the routers alone, model-free workers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tandem.router.classify import prefill_leg_body

NAN = float("nan")
# the model-free worker of the router's tests
FAKE_WORKER = Path(__file__).resolve().parents[1] / "tests" / "fake_worker.py"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


@dataclass(frozen=True)
class Sample:
    ok: bool
    ttft_s: float
    e2e_s: float
    decode_ttft_s: float


@dataclass(frozen=True)
class Row:
    path: str
    concurrency: int
    num_requests: int
    num_failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    e2e_p50_ms: float
    decode_ttft_p50_ms: float | None
    requests_per_s: float


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return NAN
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def read_stream(response: aiohttp.ClientResponse, started: float) -> tuple[float, bool]:
    """(seconds to the first token or NaN, whether the stream ended with [DONE] and no error)."""
    first_token: float | None = None
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            data = event[len(b"data: ") :]
            if data == b"[DONE]":
                return (NAN, False) if first_token is None else (first_token, True)
            payload = json.loads(data)
            if "error" in payload:
                return NAN, False
            choices = payload.get("choices")
            if first_token is None and choices and choices[0].get("text"):
                first_token = time.perf_counter() - started
    return NAN, False


async def via_router(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Sample:
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            await response.read()
            return Sample(False, NAN, NAN, NAN)
        ttft, ok = await read_stream(response, started)
    return Sample(ok, ttft, time.perf_counter() - started, NAN)


async def direct(
    session: aiohttp.ClientSession, prefill_url: str, decode_url: str, body: dict[str, Any]
) -> Sample:
    started = time.perf_counter()
    async with session.post(prefill_url + "/v1/completions", json=prefill_leg_body(body)) as leg:
        answer = await leg.json()
    ttft = time.perf_counter() - started
    kv_transfer_params = answer.get("kv_transfer_params") if leg.status == 200 else None
    if kv_transfer_params is None:
        return Sample(leg.status == 200, ttft, ttft, ttft)
    decode_body = dict(body, kv_transfer_params=kv_transfer_params)
    async with session.post(decode_url + "/v1/completions", json=decode_body) as response:
        decode_ttft, ok = await read_stream(response, started)
    return Sample(ok and response.status == 200, ttft, time.perf_counter() - started, decode_ttft)


async def run_level(
    send: Any, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[Sample], float]:
    """Sends every body, `concurrency` at a time; returns the samples and the wall time."""
    next_index = iter(range(len(bodies)))
    samples: list[Sample] = []

    async def client() -> None:
        for index in next_index:
            try:
                samples.append(await send(index, bodies[index]))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                samples.append(Sample(False, NAN, NAN, NAN))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - started


def start_process(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:g} s")


async def served_model(session: aiohttp.ClientSession, worker_url: str) -> str:
    async with session.get(worker_url + "/v1/models") as response:
        return (await response.json())["data"][0]["id"]


def summarize(
    path: str, concurrency: int, samples: list[Sample], wall_s: float, baseline: Row | None
) -> Row:
    good = [sample for sample in samples if sample.ok]
    ttfts = [sample.ttft_s for sample in good]
    decode_ttfts = [sample.decode_ttft_s for sample in good if not math.isnan(sample.decode_ttft_s)]
    p50, p99 = percentile(ttfts, 0.5) * 1e3, percentile(ttfts, 0.99) * 1e3
    return Row(
        path=path,
        concurrency=concurrency,
        num_requests=len(samples),
        num_failed=len(samples) - len(good),
        ttft_p50_ms=p50,
        ttft_p99_ms=p99,
        added_p50_ms=None if baseline is None else p50 - baseline.ttft_p50_ms,
        added_p99_ms=None if baseline is None else p99 - baseline.ttft_p99_ms,
        e2e_p50_ms=percentile([sample.e2e_s for sample in good], 0.5) * 1e3,
        decode_ttft_p50_ms=percentile(decode_ttfts, 0.5) * 1e3 if decode_ttfts else None,
        requests_per_s=len(good) / wall_s,
    )


def print_table(rows: list[Row]) -> None:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    print(
        "| path | concurrency | requests (failed) | TTFT p50 ms | TTFT p99 ms | added p50 ms | "
        "added p99 ms | decode TTFT p50 ms | e2e p50 ms | req/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row.path} | {row.concurrency} | {row.num_requests} ({row.num_failed}) | "
            f"{cell(row.ttft_p50_ms)} | {cell(row.ttft_p99_ms)} | {cell(row.added_p50_ms)} | "
            f"{cell(row.added_p99_ms)} | {cell(row.decode_ttft_p50_ms)} | {cell(row.e2e_p50_ms)} | "
            f"{row.requests_per_s:.1f} |"
        )


async def benchmark(args: argparse.Namespace) -> list[Row]:
    processes: list[subprocess.Popen[bytes]] = []
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout)
    try:
        prefill_urls, decode_urls = list(args.prefill), list(args.decode)
        if args.fake_workers:
            for role, urls in (("prefill", prefill_urls), ("decode", decode_urls)):
                port = free_port()
                fake = [sys.executable, str(FAKE_WORKER), "--role", role]
                processes.append(start_process([*fake, "--port", str(port)]))
                urls.append(f"http://127.0.0.1:{port}")
        if not prefill_urls or not decode_urls:
            raise SystemExit("give --prefill and --decode worker URLs, or --fake-workers")
        for url in prefill_urls + decode_urls:
            await wait_healthy(session, url, 120)
        model = args.model or await served_model(session, prefill_urls[0])

        paths: dict[str, str] = {}
        tandem_port = free_port()
        router = [sys.executable, "-m", "tandem.cli", "router", "--port", str(tandem_port)]
        router += ["--log-level", "warning"]
        for url in prefill_urls:
            router += ["--prefill", url]
        for url in decode_urls:
            router += ["--decode", url]
        processes.append(start_process(router))
        paths["tandem"] = f"http://127.0.0.1:{tandem_port}"
        vllm_router = args.vllm_router or shutil.which("vllm-router")
        if vllm_router:
            vllm_port = free_port()
            command = [vllm_router, "--vllm-pd-disaggregation", "--host", "127.0.0.1"]
            command += ["--port", str(vllm_port), "--prometheus-port", str(free_port())]
            command += ["--worker-startup-check-interval", "1", "--log-level", "warning"]
            for url in prefill_urls:
                command += ["--prefill", url]
            for url in decode_urls:
                command += ["--decode", url]
            processes.append(start_process(command))
            paths["vllm-router"] = f"http://127.0.0.1:{vllm_port}"
        else:
            print("vllm-router not found (pip install vllm-router): measuring tandem only")
        for url in paths.values():
            await wait_healthy(session, url, 120)

        rng = random.Random(args.seed)

        def make_bodies(count: int, tag: str) -> list[dict[str, Any]]:
            return [
                {
                    "model": model,
                    "prompt": f"{tag} {index}: "
                    + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words)),
                    "max_tokens": args.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                }
                for index in range(count)
            ]

        def direct_send(index: int, body: dict[str, Any]) -> Any:
            prefill = prefill_urls[index % len(prefill_urls)]
            return direct(session, prefill, decode_urls[index % len(decode_urls)], body)

        senders = {"direct": direct_send}
        for name, url in paths.items():
            senders[name] = lambda index, body, url=url: via_router(session, url, body)

        for name, send in senders.items():
            await run_level(send, make_bodies(args.warmup, f"warmup {name}"), 4)

        rows: list[Row] = []
        for concurrency in args.concurrency:
            count = args.requests or max(64, 4 * concurrency)
            baseline: Row | None = None
            for name, send in senders.items():
                bodies = make_bodies(count, f"{name} c{concurrency}")
                samples, wall_s = await run_level(send, bodies, concurrency)
                row = summarize(name, concurrency, samples, wall_s, baseline)
                baseline = baseline or row
                rows.append(row)
                print(f"  {name} at concurrency {concurrency}: done", file=sys.stderr)
        return rows
    finally:
        await session.close()
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", metavar="URL", action="append", default=[])
    parser.add_argument("--decode", metavar="URL", action="append", default=[])
    parser.add_argument("--fake-workers", action="store_true", help="start model-free workers")
    parser.add_argument("--model", help="default: the name the first prefill worker serves")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--requests", type=int, help="per path and level (default 4 x conc, >= 64)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--vllm-router", help="vllm-router binary (default: from PATH)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the rows and settings as JSON here")
    args = parser.parse_args()

    rows = asyncio.run(benchmark(args))
    print(
        f"host: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"{args.prompt_words}-word prompts, max_tokens {args.max_tokens}"
    )
    print_table(rows)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(
                {"settings": vars(args), "rows": [asdict(row) for row in rows]}, out, indent=1
            )


if __name__ == "__main__":
    main()
