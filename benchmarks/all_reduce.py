"""Small all-reduces between two GPUs, as a tensor-parallel decode step makes them: NCCL against
torch's symmetric-memory one-shot all-reduce, each captured 64 times in a CUDA graph.

Two processes (one per GPU) join one NCCL process group; for each shape (rows x hidden, bf16)
each checks the one-shot result against NCCL's, then times the graph's replays with CUDA events
(50 replays after 5) and prints microseconds per all-reduce, rank 0's line first. The one-shot
all-reduce reads every peer's buffer over NVLink (no multicast), from a buffer both ranks
allocate with `symm_mem.empty` and join with `symm_mem.rendezvous`.

    python benchmarks/all_reduce.py
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(1, 4096), (8, 4096), (32, 4096), (64, 4096), (64, 1024)]
CALLS_PER_GRAPH, REPLAYS = 64, 50


def graph_us(fn) -> float:
    """Microseconds per call of fn (which makes CALLS_PER_GRAPH all-reduces) as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS / CALLS_PER_GRAPH


def time_shape(rows: int, hidden: int, group: str) -> dict[str, float]:
    import torch.distributed._symmetric_memory as symm_mem

    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    buffer = symm_mem.empty(rows * hidden, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buffer, group)

    def one_shot(y: torch.Tensor) -> torch.Tensor:
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(buffer, y.reshape(-1), "sum", group)
        return out.view(rows, hidden)

    def nccl_calls() -> None:
        y = x.clone()
        for _ in range(CALLS_PER_GRAPH):
            dist.all_reduce(y)

    def one_shot_calls() -> None:
        y = x
        for _ in range(CALLS_PER_GRAPH):
            y = one_shot(y)

    reference = x.clone()
    dist.all_reduce(reference)
    error = (one_shot(x).float() - reference.float()).norm() / reference.float().norm()
    return {"relative_error": error.item(), "nccl_us": graph_us(nccl_calls),
            "one_shot_us": graph_us(one_shot_calls)}  # fmt: skip


def rank_main(rank: int, size: int, port: int, results) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    group = dist.group.WORLD.group_name
    timed = {f"{rows}x{hidden}": time_shape(rows, hidden, group) for rows, hidden in SHAPES}
    results.put((rank, timed))
    dist.destroy_process_group()


def main() -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, 2, 29561, results)) for r in range(2)]
    for process in ranks:
        process.start()
    by_rank = dict(results.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    print(json.dumps(by_rank))
    print(f"{torch.cuda.get_device_name(0)} x2, bf16, us per all-reduce (rank 0 / rank 1)")
    print("| rows x hidden | NCCL | one-shot (symmetric memory) |")
    print("| --- | --- | --- |")
    for shape in by_rank[0]:
        first, second = by_rank[0][shape], by_rank[1][shape]
        print(f"| {shape} | {first['nccl_us']:.1f} / {second['nccl_us']:.1f} | "
              f"{first['one_shot_us']:.1f} / {second['one_shot_us']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
