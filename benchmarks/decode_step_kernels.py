"""Where a decode step's GPU time goes, kernel by kernel, on rank 0 (Llama-3.1-8B shape, dummy
weights, bf16, CUDA graphs).

`--batch` requests of 128 random prompt tokens decode; after 15 steps torch's profiler records 20
engine steps and their kernels are read from its trace in the order they ran. Under programmatic
dependent launch each kernel starts early and waits for the one before, so its own duration
counts that wait; here each kernel is charged instead from the end of the one before to its own
end (its share of the GPU's critical path), and a gap of over 200 µs, the host's part between
two steps, is charged to none. Prints the chain's time a step and, for the kernels that take
most of it, their share a step, calls a step and µs a call on the chain (and their own duration),
then the same as one JSON line.

    python benchmarks/decode_step_kernels.py --tp 2 --batch 1
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import torch
from gpu_suite import end_child, random_requests  # this script's folder is on sys.path
from torch.profiler import ProfilerActivity, profile

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore

WARM_STEPS, STEPS, BETWEEN_STEPS_US, ROWS = 15, 20, 200, 14
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def traced_steps(size: int, batch: int) -> list[dict]:
    """The GPU events of STEPS engine steps, in the order they started."""
    core = EngineCore(EngineConfig(
        model="llama-3.1-8b", load_format="dummy", device="cuda:0", tensor_parallel_size=size,
        max_num_batched_tokens=8192, max_num_seqs=64, max_model_len=16384,
        gpu_memory_utilization=0.85,
    ))  # fmt: skip
    request = random_requests(core)
    for index in range(batch):
        core.add_request(request(f"d{index}", 128, WARM_STEPS + STEPS + 10))
    for _ in range(WARM_STEPS):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(STEPS):
            core.step()
        torch.cuda.synchronize()
    core.shutdown()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        profiler.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    return sorted((e for e in events if e.get("cat") in GPU_EVENTS), key=lambda e: e["ts"])


def critical_path(events: list[dict]) -> tuple[collections.Counter, ...]:
    """By kernel name: µs charged on the chain, calls charged, and their own µs."""
    charged, calls, own = collections.Counter(), collections.Counter(), collections.Counter()
    previous_end = None
    for event in events:
        name, end = event["name"][:60], event["ts"] + event["dur"]
        if previous_end is not None and end - previous_end <= BETWEEN_STEPS_US:
            charged[name] += max(end - previous_end, 0)
            calls[name] += 1
            own[name] += event["dur"]
        previous_end = end if previous_end is None else max(previous_end, end)
    return charged, calls, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding")
    args = parser.parse_args()
    charged, calls, own = critical_path(traced_steps(args.tp, args.batch))
    chain_ms = sum(charged.values()) / STEPS / 1e3
    print(f"TP={args.tp}, batch {args.batch}: the chain {chain_ms:.3f} ms a step, "
          f"{sum(calls.values()) / STEPS:.0f} kernels a step")  # fmt: skip
    print(f"{'ms a step':>10} {'calls':>6} {'us a call':>10} {'own us':>7}  kernel")
    rows = {}
    for name, us in charged.most_common(ROWS):
        rows[name] = {
            "ms_a_step": us / STEPS / 1e3,
            "calls_a_step": calls[name] / STEPS,
            "us_a_call": us / calls[name],
            "own_us_a_call": own[name] / calls[name],
        }
        print(
            f"{rows[name]['ms_a_step']:10.3f} {rows[name]['calls_a_step']:6.1f} "
            f"{rows[name]['us_a_call']:10.2f} {rows[name]['own_us_a_call']:7.2f}  {name}"
        )
    end_child({"tp": args.tp, "batch": args.batch, "chain_ms": chain_ms, "kernels": rows})


if __name__ == "__main__":
    main()
