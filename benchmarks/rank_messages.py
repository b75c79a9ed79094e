"""The step message a tensor-parallel engine's rank 0 sends its other ranks: its size and the
host time to encode it (rank 0) and decode it (each other rank), every decode step, for the
whole `SchedulerOutput` against `for_other_ranks` (what the ranks are sent: no sampling inputs).

Decode steps of `batch` requests, each with a prompt of `context` tokens and 128 generated, its
whole block table and default sampling parameters; msgspec's msgpack encoder and the ranks'
decoder, median of 50 after warm-up, on this machine's CPU (the host side of a GPU step):

    python benchmarks/rank_messages.py
"""

from __future__ import annotations

import statistics
import time

import msgspec

from tandem.engine.outputs import ScheduledRequest, SchedulerOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.executor.rank import MESSAGE_DECODER, ExecuteModel, for_other_ranks

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


def message_of(step: SchedulerOutput, stripped: bool) -> ExecuteModel:
    return ExecuteModel(for_other_ranks(step) if stripped else step)


def main() -> None:
    encoder = msgspec.msgpack.Encoder()
    print("| batch x prompt | message | KB | rank 0 encodes, us | a rank decodes, us |")
    print("|---|---|---|---|---|")
    for batch, prompt in CASES:
        step = decode_step(batch, prompt)
        for name, stripped in (("whole step", False), ("for_other_ranks", True)):
            message = encoder.encode(message_of(step, stripped))
            encode = median_us(lambda: encoder.encode(message_of(step, stripped)))  # noqa: B023
            decode = median_us(lambda: MESSAGE_DECODER.decode(message))  # noqa: B023
            print(f"| {batch} x {prompt} | {name} | {len(message) / 1e3:.1f} | {encode:.0f} | "
                  f"{decode:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
