"""The host time of CUDA calls made right after the calling thread idled: one cuda-ipc block
copy's launch (`BlockCopier.launch`, behind an event) and one event record, each after an idle
stretch of the given length, spent as the engine's busy poll spends it (ZeroMQ polls of an
ipc:// socket without sleeping), in a pure Python loop, asleep, or polling with some other work
done every so often. Each time is the median of 40, with the thread's CPU time beside it (a
wait would show as wall time above CPU time). A decode engine queues a handoff's copy right
after such a stretch.

    python benchmarks/idle_launch.py [--device cuda:1] [--repeats 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import zmq
from copy_launch import warmed_copier

BLOCK_IDS = list(range(8))  # 128 tokens


class Idler:
    """Idle stretches in one style; the styles with work do it on a period (seconds)."""

    def __init__(self, device: torch.device) -> None:
        context = zmq.Context.instance()
        self.socket = context.socket(zmq.PULL)
        # an ipc:// socket, as the engine's input
        self.socket.bind(f"ipc://{tempfile.gettempdir()}/idle-launch-{os.getpid()}")
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.event = torch.cuda.Event()
        self.tiny = torch.zeros(1, device=device)
        self.styles: dict[str, tuple[Callable[[], object] | None, float]] = {
            "poll": (None, 0.0),
            "poll + event record every 0.1 ms": (self.event.record, 1e-4),
            "poll + event record every 1 ms": (self.event.record, 1e-3),
            "poll + tiny kernel every 1 ms": (lambda: self.tiny.add_(1), 1e-3),
            "poll + Python work every 1 ms": (python_work, 1e-3),
        }

    def idle(self, style: str, seconds: float) -> None:
        end = time.monotonic() + seconds
        if style == "sleep":
            time.sleep(seconds)
        elif style == "Python loop":
            while time.monotonic() < end:
                pass
        else:
            work, period = self.styles[style]
            last = time.monotonic()
            while (now := time.monotonic()) < end:
                self.poller.poll(0)
                if work is not None and now - last > period:
                    work()
                    last = now


def python_work() -> dict[int, str]:
    return {i: str(i) * 2 for i in range(300)}


def median_microseconds(
    function: Callable[[], object], idler: Idler, style: str, gap_s: float, repeats: int
) -> tuple[float, float]:
    """(wall, thread CPU) medians of `function` after each idle stretch, in µs."""
    walls, cpus = [], []
    for _ in range(repeats):
        idler.tiny.add_(1)  # the GPU worked before the stretch, as after a request's step
        torch.cuda.synchronize()
        idler.idle(style, gap_s)
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        function()
        walls.append((time.perf_counter_ns() - wall) / 1e3)
        cpus.append((time.thread_time_ns() - cpu) / 1e3)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:1" if torch.cuda.device_count() > 1 else "cuda")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    copier, _, remote, after = warmed_copier(device, BLOCK_IDS)
    record = torch.cuda.Event()
    calls = {
        "copy launch": lambda: copier.launch(remote, BLOCK_IDS, BLOCK_IDS, after=after),
        "event record": record.record,
    }
    idler = Idler(device)
    runs = [("poll", gap) for gap in (0.0, 0.0002, 0.002, 0.02)]
    runs += [(style, 0.02) for style in ("Python loop", "sleep", *list(idler.styles)[1:])]
    print(f"{torch.cuda.get_device_name(device)}, median of {args.repeats}, wall / CPU µs")
    print(f"| idle | ms | {' | '.join(calls)} |\n|---|---|{'---|' * len(calls)}")
    for style, gap in runs:
        cells = []
        for function in calls.values():
            wall, cpu = median_microseconds(function, idler, style, gap, args.repeats)
            cells.append(f"{wall:.1f} / {cpu:.1f}")
        print(f"| {style} | {gap * 1e3:g} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
