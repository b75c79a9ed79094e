"""Tensor parallelism on GPUs: the Llama-3.1-8B shape (dummy weights, bf16) at TP=1, 2 and 4.

    python benchmarks/tensor_parallel.py --out tp.json [--configs tp1 tp2 tp2-nccl tp2-eager tp4]

For each configuration (TP=1 with decode CUDA graphs; TP=2 with them, its small all-reduces over
peer memory; the same with every all-reduce on NCCL; TP=2 eager; TP=4 as TP=2, on four GPUs),
in a process of its own so each starts on empty GPUs: the wall time of one 8192-token prefill
step and of one decode step at batch 1 (context 128 to 288), medians after warm-up, the GPU time
of rank 0's decode graph within the step (CUDA events around its replay; the rest of the step is
the host's), and each step against its ceiling on one rank (BENCHMARKS.md workload 5): the
prefill's matrix FLOPs on rank 0 (`gpu_suite.prefill_flops`) per second over the measured bf16
matrix rate, and the decode step's roofline, the bytes one rank reads per step (its weight shard
and its KV heads) over the measured device copy bandwidth. Prints the table, with TP=N over TP=1
for both steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from gpu_suite import (  # this script's folder is on sys.path when it runs
    ceilings,
    end_child,
    first_rank,
    measure_in_children,
    prefill_flops,
    prefill_step_s,
    random_requests,
    step_times_until_done,
    weight_bytes,
)

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore

# name: (tensor-parallel size, enforce_eager, disable_custom_all_reduce)
CONFIGS = {
    "tp1": (1, False, False),
    "tp2": (2, False, False),
    "tp2-nccl": (2, False, True),
    "tp2-eager": (2, True, False),
    "tp4": (4, False, False),
}
PROMPT = 8192


def timed_replays(core: EngineCore) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    """CUDA events around each replay of rank 0's batch-1 decode graph from now on: the GPU's
    time for the pass (under TP, waits for the other ranks at its collectives included)."""
    graph = first_rank(core).runner.decode_graphs.graphs[1]
    replay, events = graph.replay, []

    def timed_replay() -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        events.append((start, end))

    graph.replay = timed_replay
    return events


def measure(name: str) -> dict:
    size, eager, nccl_only = CONFIGS[name]
    limits = ceilings(peer_copy=False)  # GPU 1 is rank 1's
    core = EngineCore(
        EngineConfig(
            model="llama-3.1-8b",
            load_format="dummy",
            device="cuda:0",
            tensor_parallel_size=size,
            enforce_eager=eager,
            disable_custom_all_reduce=nccl_only,
            max_num_batched_tokens=PROMPT,
            max_num_seqs=8,
            max_model_len=16384,
            gpu_memory_utilization=0.85,
        )
    )
    request = random_requests(core)
    prefill_s = prefill_step_s(core, request, PROMPT)
    core.add_request(request("decode", 128, 160))
    core.step()
    replays = [] if eager else timed_replays(core)
    decode_s = statistics.median(step_times_until_done(core)[10:])
    replay_ms = [start.elapsed_time(end) for start, end in replays[10:]]
    # rank 0's reads in a step: its weight shard and its share of the context's KV
    decode_bytes = weight_bytes(core, decode=True) + (128 + 80) * core.kv_spec.bytes_per_token
    roofline_s = decode_bytes / (limits["copy_GBps"] * 1e9)
    prefill_tflops = prefill_flops(core, PROMPT) / prefill_s / 1e12  # rank 0's share
    core.shutdown()
    return {
        "prefill_8192_ms": prefill_s * 1e3,
        "prefill_TFLOPs_per_rank": prefill_tflops,
        "prefill_fraction_of_matmul": prefill_tflops / limits["matmul_bf16_TFLOPs"],
        "decode_step_b1_ms": decode_s * 1e3,
        "decode_graph_gpu_ms": statistics.median(replay_ms) if replay_ms else None,
        "decode_roofline_ms": roofline_s * 1e3,
        "decode_roofline_fraction": roofline_s / decode_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        end_child(measure(args.child))
    results = measure_in_children(__file__, args.configs)
    print(f"{'config':<10} {'prefill 8192 ms':>16} {'of matmul rate':>15} {'decode b1 ms':>13} "
          f"{'graph GPU ms':>13} {'roofline frac':>14}")  # fmt: skip
    for name, row in results.items():
        gpu_ms = row["decode_graph_gpu_ms"]
        print(
            f"{name:<10} {row['prefill_8192_ms']:>16.1f} "
            f"{row['prefill_fraction_of_matmul']:>15.2f} {row['decode_step_b1_ms']:>13.2f} "
            f"{'-' if gpu_ms is None else f'{gpu_ms:.2f}':>13} "
            f"{row['decode_roofline_fraction']:>14.2f}"
        )
    tp1 = results.get("tp1")
    for name, row in results.items():
        if tp1 and name != "tp1":
            prefill = row["prefill_8192_ms"] / tp1["prefill_8192_ms"]
            decode = row["decode_step_b1_ms"] / tp1["decode_step_b1_ms"]
            print(f"{name} / tp1: prefill {prefill:.2f}x, decode step {decode:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
