"""How long a worker's nixl data plane takes to register its KV cache: the plane registers the
whole cache with both of its NIXL agents (the serving and the reading one, kv/data/nixl.py), so a
worker's start pays two registrations, and an RDMA NIC holds two memory regions of the cache.

For each cache size: one tensor of that many GB (bf16) on GPU 0 (or in host memory with
--device cpu), registered with a first agent, then a second, as the plane's `_register` does,
then both deregistered; wall-clock seconds each. UCX picks its transports from its environment.

    PYTHONPATH=src python benchmarks/kv_registration.py [--gb 8 32 100] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.kv.data.nixl import VRAM_UCX_WORKERS, new_agent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, nargs="+", default=[8.0, 32.0, 100.0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    memory_type = "VRAM" if args.device == "cuda" else "DRAM"
    workers = VRAM_UCX_WORKERS if args.device == "cuda" else 1
    print(f"nixl registration of one KV cache tensor ({memory_type}), seconds")
    print("| cache GB | serving agent | reading agent | both deregistered |")
    print("|---|---|---|---|")
    for gb in args.gb:
        cache = torch.empty(int(gb * 1e9) // 2, dtype=torch.bfloat16, device=args.device)
        agents = [new_agent(workers, progress_thread=True), new_agent(workers, False)]
        registrations, times = [], []
        for agent in agents:
            started = time.perf_counter()
            registrations.append(agent.register_memory(cache))
            times.append(time.perf_counter() - started)
        assert all(r.descCount() == 1 for r in registrations), "one region a registration"
        started = time.perf_counter()
        for agent, registration in zip(agents, registrations, strict=True):
            agent.deregister_memory(registration)
        released = time.perf_counter() - started
        print(f"| {gb:g} | {times[0]:.3f} | {times[1]:.3f} | {released:.3f} |")
        del cache, agents
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
