"""Tensor parallelism on GPUs: the Llama-3.1-8B shape (dummy weights, bf16) at TP=1, 2 and 4.

    python benchmarks/tensor_parallel.py --out tp.json [--configs tp1 tp2 tp2-nccl tp2-eager tp4
                                                              tp1-async tp2-async tp4-async]

For each configuration (TP=1 with decode CUDA graphs; TP=2 with them, its small all-reduces over
peer memory; the same with every all-reduce on NCCL; TP=2 eager; TP=4 as TP=2, on four GPUs;
TP=1, 2 and 4 with async scheduling),
in a process of its own so each starts on empty GPUs: the wall time of one 8192-token prefill
step and of one decode step at batch 1 (context 128 to 288), medians after warm-up, the GPU time
of rank 0's decode graph within the step (CUDA events around its replay; the rest of the step is
the host's), the same two at batches 32 and 64 (the all-reduces carry a row a sequence), and
each step against its ceiling on one rank (BENCHMARKS.md workload 5): the prefill's matrix
FLOPs on rank 0 (`gpu_suite.prefill_flops`) per second over the measured bf16 matrix rate, and
the decode step's roofline, the bytes one rank reads per step (its weight shard and its KV
heads) over the measured device copy bandwidth. Prints the table, with TP=N over TP=1 for both
steps.
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

# name: (tensor-parallel size, enforce_eager, disable_custom_all_reduce, async_scheduling)
CONFIGS = {
    "tp1": (1, False, False, False),
    "tp2": (2, False, False, False),
    "tp2-nccl": (2, False, True, False),
    "tp2-eager": (2, True, False, False),
    "tp4": (4, False, False, False),
    "tp1-async": (1, False, False, True),
    "tp2-async": (2, False, False, True),
    "tp4-async": (4, False, False, True),
}
PROMPT = 8192
LOADED_BATCHES = (32, 64)


def timed_replays(core: EngineCore) -> dict[int, list[float]]:
    """Rank 0's decode graphs, each replay from now on timed with CUDA events: the GPU's time
    for the pass (under TP, waits for the other ranks at its collectives included), in ms, by
    the graph's batch size (read once the steps are done)."""
    graphs = first_rank(core).runner.decode_graphs.graphs
    events: dict[int, list] = {batch: [] for batch in graphs}
    for batch, graph in graphs.items():

        def timed_replay(replay=graph.replay, timed=events[batch]) -> None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            timed.append((start, end))

        graph.replay = timed_replay
    return events


def median_ms(events: list) -> float | None:
    """The median of the replays' times after the first ten."""
    times = [start.elapsed_time(end) for start, end in events[10:]]
    return statistics.median(times) if times else None


def measure(name: str) -> dict:
    size, eager, nccl_only, async_scheduling = CONFIGS[name]
    limits = ceilings(peer_copy=False)  # GPU 1 is rank 1's
    core = EngineCore(
        EngineConfig(
            model="llama-3.1-8b",
            load_format="dummy",
            device="cuda:0",
            tensor_parallel_size=size,
            enforce_eager=eager,
            disable_custom_all_reduce=nccl_only,
            async_scheduling=async_scheduling,
            max_num_batched_tokens=PROMPT,
            max_num_seqs=max(LOADED_BATCHES),
            max_model_len=16384,
            gpu_memory_utilization=0.85,
        )
    )
    request = random_requests(core)
    prefill_s = prefill_step_s(core, request, PROMPT)
    core.add_request(request("decode", 128, 160))
    core.step()
    replays = {} if eager else timed_replays(core)
    decode_s = statistics.median(step_times_until_done(core)[10:])
    loaded_ms = {}
    for batch in LOADED_BATCHES:  # one step prefills them all, then they decode together
        for index in range(batch):
            core.add_request(request(f"decode-{batch}-{index}", 128, 160))
        loaded_ms[batch] = statistics.median(step_times_until_done(core)[10:]) * 1e3
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
        "decode_graph_gpu_ms": median_ms(replays.get(1, [])),
        **{f"decode_step_b{batch}_ms": ms for batch, ms in loaded_ms.items()},
        **{f"decode_graph_gpu_b{b}_ms": median_ms(replays.get(b, [])) for b in LOADED_BATCHES},
        "decode_roofline_ms": roofline_s * 1e3,
        "decode_roofline_fraction": roofline_s / decode_s,
    }


def decode_ratios(row: dict, base: dict) -> str:
    ratios = [
        f"b{batch} {row[f'decode_step_b{batch}_ms'] / base[f'decode_step_b{batch}_ms']:.2f}x"
        for batch in (1, *LOADED_BATCHES)
    ]
    return f"decode step {', '.join(ratios)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        end_child(measure(args.child))
    results = measure_in_children(__file__, args.configs)
    loaded = "".join(f"{f'decode b{b} ms':>15}{f'b{b} GPU ms':>12}" for b in LOADED_BATCHES)
    print(f"{'config':<10} {'prefill 8192 ms':>16} {'of matmul rate':>15} {'decode b1 ms':>13} "
          f"{'graph GPU ms':>13} {'roofline frac':>14}{loaded}")  # fmt: skip

    def shown(ms: float | None, width: int) -> str:
        return f"{'-' if ms is None else f'{ms:.2f}':>{width}}"

    for name, row in results.items():
        print(
            f"{name:<10} {row['prefill_8192_ms']:>16.1f} "
            f"{row['prefill_fraction_of_matmul']:>15.2f} {row['decode_step_b1_ms']:>13.2f} "
            f"{shown(row['decode_graph_gpu_ms'], 13)} {row['decode_roofline_fraction']:>14.2f}"
            + "".join(
                shown(row[f"decode_step_b{b}_ms"], 15) + shown(row[f"decode_graph_gpu_b{b}_ms"], 12)
                for b in LOADED_BATCHES
            )
        )
    for name, row in results.items():
        base_name = "tp1-async" if name.endswith("-async") else "tp1"  # the same scheduling
        base = results.get(base_name)
        if base and name != base_name:
            prefill = row["prefill_8192_ms"] / base["prefill_8192_ms"]
            print(f"{name} / {base_name}: prefill {prefill:.2f}x, {decode_ratios(row, base)}")
    if "tp1" in results and "tp1-async" in results:
        print(f"tp1-async / tp1: {decode_ratios(results['tp1-async'], results['tp1'])}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
