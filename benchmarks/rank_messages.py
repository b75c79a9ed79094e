"""The step message a tensor-parallel engine's rank 0 sends its other ranks: its size and the
host time to encode it (rank 0) and decode it (each other rank), every decode step, for the
whole `SchedulerOutput` against `for_other_ranks` (what the ranks are sent: no sampling inputs,
and of each block table only the ids the ranks do not hold from the step before).

Decode steps of `batch` requests, each with a prompt of `context` tokens and 128 generated, its
block table and default sampling parameters; msgspec's msgpack encoder and the ranks' decoder,
median of 50 after warm-up, on this machine's CPU (the host side of a GPU step):

    python benchmarks/rank_messages.py
"""

from __future__ import annotations

import statistics
import time

import msgspec

from tandem.engine.outputs import ScheduledRequest, SchedulerOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.executor.rank import MESSAGE_DECODER, BlockTables, for_other_ranks

CASES = [(1, 128), (64, 1024), (64, 8192)]  # (batch, prompt tokens)
GENERATED, BLOCK_SIZE, REPEATS = 128, 16, 50


def decode_step(batch: int, prompt: int) -> SchedulerOutput:
    context = prompt + GENERATED
    num_blocks = -(-context // BLOCK_SIZE)
    requests = [
        ScheduledRequest(
            f"request-{index}",
            [11],
            context,
            list(range(index * num_blocks, (index + 1) * num_blocks)),
            True,
            SamplingParams(max_tokens=256),
            GENERATED,
            list(range(prompt)),
            list(range(GENERATED)),
        )  # fmt: skip
        for index in range(batch)
    ]
    return SchedulerOutput(requests, batch)


def median_us(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def timings(step: SchedulerOutput, kind: str) -> tuple[int, float, float]:
    """(bytes, rank 0's encode us, a rank's decode us) of one step's message: the whole step;
    for_other_ranks with every table sent whole (the requests' first step); or for_other_ranks
    the step after one that sent the same tables (a steady decode step). The encode includes
    rank 0's table bookkeeping, the decode the other rank's rebuilding of the tables."""
    encoder = msgspec.msgpack.Encoder()
    if kind == "whole step":
        message = encoder.encode(step)
        whole = msgspec.msgpack.Decoder(SchedulerOutput)
        return (
            len(message),
            median_us(lambda: encoder.encode(step)),
            median_us(lambda: whole.decode(message)),
        )
    rank0, other = BlockTables(), BlockTables()
    if kind == "tables held":
        other.restore(MESSAGE_DECODER.decode(encoder.encode(for_other_ranks(step, rank0))))

    def send() -> bytes:
        return encoder.encode(
            for_other_ranks(step, rank0 if kind == "tables held" else BlockTables())
        )

    def receive() -> None:
        other.restore(MESSAGE_DECODER.decode(message))

    message = send()
    return len(message), median_us(send), median_us(receive)


def main() -> None:
    print("| batch x prompt | message | KB | rank 0 encodes, us | a rank decodes, us |")
    print("|---|---|---|---|---|")
    for batch, prompt in CASES:
        step = decode_step(batch, prompt)
        for kind in ("whole step", "tables sent whole", "tables held"):
            size, encode, decode = timings(step, kind)
            print(f"| {batch} x {prompt} | {kind} | {size / 1e3:.1f} | {encode:.0f} | "
                  f"{decode:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
