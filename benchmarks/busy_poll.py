"""The engine loop's busy polling, A/B on one GPU: two `both` workers on GPU 0, one with
`--busy-poll-s 0` (its loop sleeps on its inputs between requests) and one with the default;
one-token requests, one at a time with a 20 ms pause before each (a client's think time),
alternating between the two workers; the workers' own TTFT and the client's time, p10/p50/p90.

    python benchmarks/busy_poll.py [--lengths 128 1024] [--rounds 60]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import torch

# benchmarks/ is on sys.path when this script runs
from gpu_suite import WORKER_TTFT, metric_totals, start_process, stop_processes, wait_healthy

WORKERS = {"sleeps": ("8601", ["--busy-poll-s", "0"]), "busy polls": ("8602", [])}
COMMON = [
    "--model", "qwen3-0.6b", "--load-format", "dummy", "--host", "127.0.0.1",
    "--gpu-memory-utilization", "0.3", "--max-model-len", "16384",
    "--max-num-batched-tokens", "8192", "--device", "cuda:0",
]  # fmt: skip


def percentiles(values: list[float]) -> str:
    ordered = sorted(values)
    picks = [ordered[round(q * (len(ordered) - 1))] for q in (0.1, 0.5, 0.9)]
    return " / ".join(f"{v:.2f}" for v in picks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    urls = {name: f"http://127.0.0.1:{port}" for name, (port, _) in WORKERS.items()}
    processes = {
        name: start_process(
            ["worker", *COMMON, "--port", port, *flags], args.log_dir / f"busy-poll-{port}.log"
        )
        for name, (port, flags) in WORKERS.items()
    }
    try:
        for name, process in processes.items():
            wait_healthy(urls[name], process)
        generator = torch.Generator().manual_seed(0)
        print("| input | engine loop | worker TTFT p10/p50/p90 ms | client p10/p50/p90 ms |")
        print("|---|---|---|---|")
        with httpx.Client(timeout=120) as client:
            for length in args.lengths:
                times: dict[str, list[tuple[float, float]]] = {name: [] for name in WORKERS}
                for round_index in range(4 + args.rounds):  # 4 warm-up rounds
                    names = list(WORKERS)[:: 1 if round_index % 2 else -1]
                    for name in names:
                        prompt = torch.randint(0, 151000, (length,), generator=generator)
                        body = {"prompt": prompt.tolist(), "max_tokens": 1, "temperature": 0}
                        before = metric_totals(client, urls[name], [WORKER_TTFT])[WORKER_TTFT]
                        time.sleep(0.02)
                        start = time.perf_counter()
                        client.post(f"{urls[name]}/v1/completions", json=body).raise_for_status()
                        elapsed = time.perf_counter() - start
                        after = metric_totals(client, urls[name], [WORKER_TTFT])[WORKER_TTFT]
                        worker = after - before
                        if round_index >= 4:
                            times[name].append((worker * 1e3, elapsed * 1e3))
                for name, measured in times.items():
                    worker_ms = percentiles([w for w, _ in measured])
                    client_ms = percentiles([c for _, c in measured])
                    print(f"| {length} | {name} | {worker_ms} | {client_ms} |")
    finally:
        stop_processes(processes.values())


if __name__ == "__main__":
    main()
