"""All-reduces between two GPUs (or four: `--ranks 4`) as a tensor-parallel step makes them:
NCCL against torch's symmetric-memory all-reduces.

Small ones (a decode step's, one row per sequence): NCCL against the one-shot all-reduce, each
captured 64 times in a CUDA graph. Two processes (one per GPU) join one NCCL process group; for
each shape (rows x hidden, bf16) each checks the one-shot result against NCCL's, then times the
graph's replays with CUDA events (50 replays after 5) and prints microseconds per all-reduce,
rank 0's and the last rank's. The one-shot all-reduce reads every peer's buffer over NVLink (no
multicast), from a buffer both ranks allocate with `symm_mem.empty` and join with
`symm_mem.rendezvous`.

The decode layer's sum with the residual add and RMSNorm after it: the engine's one-shot
all-reduce then its add-and-norm kernel, against the fused kernel that does all three
(`tandem.distributed.fused_all_reduce`), each captured 64 times in a CUDA graph (each call's
output the next one's input), after a check that both give the same bits.

Large ones (a prompt's hidden states, up to 8192 x 4096): NCCL against the two-shot all-reduce
(each rank sums its half of every rank's buffer, then reads the other half's sum from its peer),
alone and with the copies into and out of its buffer that a model's tensors would need; eager,
20 all-reduces after 3 timed with CUDA events, milliseconds per all-reduce.

    python benchmarks/all_reduce.py [--ranks 4]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_suite import replay_ms  # this script's folder is on sys.path when it runs

SHAPES = [(1, 4096), (8, 4096), (32, 4096), (64, 4096), (64, 1024)]
FUSED_SHAPES = [(1, 4096), (8, 4096), (32, 4096), (64, 4096), (128, 4096), (64, 1024)]
PROMPT_SHAPES = [(1024, 4096), (4096, 4096), (8192, 4096)]
CALLS_PER_GRAPH, REPLAYS = 64, 50
PROMPT_CALLS = 20


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
    return replay_ms(graph, 5, REPLAYS) * 1e3 / CALLS_PER_GRAPH


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


def time_fused_shape(rows: int, hidden: int, fused, summed) -> dict[str, float]:
    from tandem.models.triton_ops import add_rms_norm

    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, hidden, generator=generator).to(device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7))
    residual = residual.to(device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16)

    def unfused(y: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(summed(y), stream, weight, 1e-5)

    def fused_step(y: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        return fused(y, stream, weight, 1e-5)

    def chain(step) -> None:
        y, stream = x, residual.clone()
        for _ in range(CALLS_PER_GRAPH):
            y = step(y, stream)

    stream_a, stream_b = residual.clone(), residual.clone()
    out_a, out_b = unfused(x, stream_a), fused_step(x, stream_b)
    same = torch.equal(out_a, out_b) and torch.equal(stream_a, stream_b)
    return {"same_bits": same, "unfused_us": graph_us(lambda: chain(unfused)),
            "fused_us": graph_us(lambda: chain(fused_step))}  # fmt: skip


def time_fused(group: str) -> dict[str, dict[str, float]]:
    import torch.distributed._symmetric_memory as symm_mem

    from tandem.distributed.fused_all_reduce import AllReduceAddRMSNorm
    from tandem.distributed.group import PEER_MEMORY_MAX_BYTES, PeerMemoryAllReduce

    rank, size, device = dist.get_rank(), dist.get_world_size(), torch.device("cuda")
    buffer = symm_mem.empty(PEER_MEMORY_MAX_BYTES // 2, dtype=torch.bfloat16, device=device)
    summed = PeerMemoryAllReduce(group, dist.group.WORLD, buffer)
    fused_buffer = AllReduceAddRMSNorm.allocate(size, PEER_MEMORY_MAX_BYTES, torch.bfloat16, device)
    fused = AllReduceAddRMSNorm(group, rank, size, torch.bfloat16, fused_buffer)
    return {
        f"{rows}x{hidden}": time_fused_shape(rows, hidden, fused, summed)
        for rows, hidden in FUSED_SHAPES
    }


def eager_ms(fn) -> float:
    """Milliseconds per call of fn, PROMPT_CALLS calls after 3, on the GPU's clock."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(PROMPT_CALLS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / PROMPT_CALLS


def time_prompt_shape(rows: int, hidden: int, group: str) -> dict[str, float]:
    import torch.distributed._symmetric_memory as symm_mem

    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    buffer = symm_mem.empty(rows * hidden, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buffer, group)

    def two_shot() -> None:
        torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", group)

    def two_shot_with_copies() -> None:
        buffer.copy_(x.view(-1))
        two_shot()
        x.view(-1).copy_(buffer)

    reference = x.clone()
    dist.all_reduce(reference)
    buffer.copy_(x.view(-1))
    two_shot()
    difference = buffer.view(rows, hidden).float() - reference.float()
    error = difference.norm() / reference.float().norm()
    return {"relative_error": error.item(), "nccl_ms": eager_ms(lambda: dist.all_reduce(x)),
            "two_shot_ms": eager_ms(two_shot),
            "two_shot_with_copies_ms": eager_ms(two_shot_with_copies)}  # fmt: skip


def rank_main(rank: int, size: int, port: int, results) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    group = dist.group.WORLD.group_name
    timed = {f"{rows}x{hidden}": time_shape(rows, hidden, group) for rows, hidden in SHAPES}
    prompts = {
        f"{rows}x{hidden}": time_prompt_shape(rows, hidden, group) for rows, hidden in PROMPT_SHAPES
    }
    fused = time_fused(group)
    results.put((rank, {"decode": timed, "prompt": prompts, "fused": fused}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=2)
    size = parser.parse_args().ranks
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, size, 29561, results)) for r in range(size)]
    for process in ranks:
        process.start()
    by_rank = dict(results.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    print(json.dumps(by_rank))
    first, last = by_rank[0], by_rank[size - 1]
    ranks_shown = f"rank 0 / rank {size - 1}"
    print(f"{torch.cuda.get_device_name(0)} x{size}, bf16, us per all-reduce ({ranks_shown})")
    print("| rows x hidden | NCCL | one-shot (symmetric memory) |")
    print("| --- | --- | --- |")
    for shape in first["decode"]:
        a, b = first["decode"][shape], last["decode"][shape]
        print(f"| {shape} | {a['nccl_us']:.1f} / {b['nccl_us']:.1f} | "
              f"{a['one_shot_us']:.1f} / {b['one_shot_us']:.1f} |")  # fmt: skip
    print(f"\nthe sum with the residual add and RMSNorm, us per call ({ranks_shown})")
    print("| rows x hidden | one-shot, then add and norm | fused | same bits |")
    print("| --- | --- | --- | --- |")
    for shape in first["fused"]:
        a, b = first["fused"][shape], last["fused"][shape]
        same = all(by_rank[rank]["fused"][shape]["same_bits"] for rank in by_rank)
        print(f"| {shape} | {a['unfused_us']:.1f} / {b['unfused_us']:.1f} | "
              f"{a['fused_us']:.1f} / {b['fused_us']:.1f} | {same} |")  # fmt: skip
    print(f"\nprompt sizes, eager, ms per all-reduce ({ranks_shown})")
    print("| rows x hidden | NCCL | two-shot | two-shot with copies in and out |")
    print("| --- | --- | --- | --- |")
    for shape in first["prompt"]:
        cells = [
            f"{first['prompt'][shape][key]:.3f} / {last['prompt'][shape][key]:.3f}"
            for key in ("nccl_ms", "two_shot_ms", "two_shot_with_copies_ms")
        ]
        print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
