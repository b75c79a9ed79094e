"""Where a request's time goes: `both` against the pd server (`--role pd`), call by call.

    python benchmarks/trace_latency.py --out traces/ [--lengths 128,1024] [--repeats 30]

Starts a `both` worker on GPU 0 and a pd server (prefill engine on GPU 0, decode engine on
GPU 1) as the latency section of gpu_suite.py does, with every process traced
(benchmarks/call_trace), and streams the same prompts to each in turn, one at a time. Then it
stops the workers and prints, per path and input length: the medians of TTFT and time to second
token at the client, the mean time per request in each traced function, and the timeline of
calls (median time of each from the client's send, those in at least half of the requests).
The tracing itself adds a few microseconds per call: compare the paths, not these times with
untraced runs. On CPU (`--device cpu --decode-device cpu`) it checks the tool, not the timings.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from gpu_suite import LATENCY_WORKER_ARGS, stream_once, wait_healthy

TRACER = Path(__file__).resolve().parent / "call_trace"
ROOT = Path(__file__).resolve().parent.parent
PORTS = {"both": 8301, "pd_server": 8306}


def start_workers(args: argparse.Namespace, trace_dir: Path) -> dict[str, subprocess.Popen]:
    # the latency section's settings; a later --model or --load-format takes the place of its own
    common = [*LATENCY_WORKER_ARGS, "--model", args.model, "--load-format", args.load_format]
    commands = {
        "both": ["--port", str(PORTS["both"]), "--device", args.device],
        "pd_server": ["--port", str(PORTS["pd_server"]), "--device", args.device, "--role", "pd",
                      "--decode-device", args.decode_device, "--gpu-memory-utilization", "0.1"],
    }  # fmt: skip
    path = os.pathsep.join([str(TRACER), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, TANDEM_CALL_TRACE_DIR=str(trace_dir))
    return {
        name: subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "worker", *common, *command],
            stdout=open(trace_dir.parent / f"{name}.log", "wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        for name, command in commands.items()
    }


def stop_workers(processes: dict[str, subprocess.Popen]) -> None:
    """SIGINT to each worker: its engines shut down through it and write their traces."""
    for process in processes.values():
        process.send_signal(signal.SIGINT)
    for process in processes.values():
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def run_requests(args: argparse.Namespace) -> list[dict]:
    import httpx

    generator = torch.Generator().manual_seed(0)
    requests = []
    with httpx.Client(timeout=300) as client:
        for num_input in args.lengths:
            for repeat in range(2 + args.repeats):  # two warm-ups
                prompt = torch.randint(0, 151000, (num_input,), generator=generator).tolist()
                order = ("both", "pd_server") if repeat % 2 == 0 else ("pd_server", "both")
                for path in order:
                    sent = time.perf_counter_ns()
                    timed = stream_once(client, f"http://127.0.0.1:{PORTS[path]}", prompt, 8)
                    if repeat >= 2:
                        requests.append({"path": path, "input": num_input, "sent": sent, **timed})
                    time.sleep(0.02)  # nothing of one request runs into the next's window
    return requests


def process_names(records: list[dict]) -> dict[int, str]:
    """`both-api`, `both-engine`, `pd-api`, `pd-prefill`, `pd-decode` by process id."""
    apis = {
        r["pid"]: "both" if f"{PORTS['both']}" in r["argv"] else "pd"
        for r in records
        if r["process"] == "MainProcess" and "--port" in r["argv"]
    }
    names = {pid: f"{server}-api" for pid, server in apis.items()}
    for record in records:
        server = apis.get(record["parent"])
        if record["pid"] in names or server is None:
            continue
        labels = {event[2] for event in record["events"]}
        role = "engine"
        if "PDConnectorWorker._await_handoff" in labels:
            role = "decode"
        elif "ControlPlane.publish" in labels:
            role = "prefill"
        names[record["pid"]] = f"{server}-{role}"
    return names


def report(requests: list[dict], trace_dir: Path) -> None:
    records = [json.loads(path.read_text()) for path in trace_dir.glob("trace-*.json")]
    names = process_names(records)
    events = sorted(  # (time, process, thread, label, phase, thread state: see call_trace)
        (time_ns, names.get(r["pid"], str(r["pid"])), thread[:16], label, phase, tuple(state))
        for r in records
        for time_ns, thread, label, phase, *state in r["events"]
    )
    times = [event[0] for event in events]
    for num_input in sorted({r["input"] for r in requests}):
        for path in PORTS:
            measured = [r for r in requests if r["input"] == num_input and r["path"] == path]
            print(
                f"\n== {path}, {num_input} input tokens, {len(measured)} requests: TTFT "
                f"{statistics.median(r['ttft_ms'] for r in measured):.3f} ms, second token "
                f"{statistics.median(r['ttst_ms'] for r in measured):.3f} ms"
            )
            offsets = defaultdict(list)
            spent = defaultdict(lambda: [0.0] * 5)  # wall ms, CPU ms, faults, switches, forced
            for request in measured:
                window = slice(
                    bisect.bisect_left(times, request["sent"]),
                    bisect.bisect_right(times, request["sent"] + request["ttst_ms"] * 1e6),
                )
                seen, entered = defaultdict(int), {}
                for time_ns, process, thread, label, phase, state in events[window]:
                    key = (process, thread, label, phase)
                    seen[key] += 1
                    offsets[key, seen[key]].append((time_ns - request["sent"]) / 1e6)
                    if phase == "in":
                        entered[process, thread, label] = (time_ns, state)
                    elif phase == "out" and (process, thread, label) in entered:
                        start, start_state = entered.pop((process, thread, label))
                        total = spent[process, thread, label]
                        total[0] += (time_ns - start) / 1e6 / len(measured)
                        if state and start_state:
                            total[1] += (state[0] - start_state[0]) / 1e6 / len(measured)
                            for index in (1, 2, 3):
                                total[index + 1] += (state[index] - start_state[index]) / len(
                                    measured
                                )
            print(
                "  per request in each function, means: wall ms, thread CPU ms, minor page "
                "faults, voluntary and involuntary context switches:"
            )
            for (process, thread, label), total in sorted(spent.items(), key=lambda kv: -kv[1][0]):
                wall, cpu, faults, switches, forced = total
                print(
                    f"    {wall:8.3f} {cpu:8.3f} {faults:7.1f} {switches:6.1f} {forced:6.1f}  "
                    f"{process:12s} {thread:16s} {label}"
                )
            print("  timeline, median ms from the client's send (count of requests):")
            rows = sorted(
                (statistics.median(values), len(values), key)
                for key, values in offsets.items()
                if len(values) >= len(measured) / 2
            )
            for ms, count, ((process, thread, label, phase), nth) in rows:
                call = f"{label}#{nth} {phase}"
                print(f"    {ms:8.3f} ({count:2d})  {process:12s} {thread:16s} {call}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="traces and worker logs")
    parser.add_argument("--lengths", default="128,1024", help="input lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=30, help="measured requests per path")
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--decode-device", default="cuda:1")
    args = parser.parse_args()
    args.lengths = [int(length) for length in args.lengths.split(",")]
    trace_dir = args.out / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    processes = start_workers(args, trace_dir)
    try:
        for path, process in processes.items():
            wait_healthy(f"http://127.0.0.1:{PORTS[path]}", process)
        requests = run_requests(args)
    finally:
        stop_workers(processes)
    report(requests, trace_dir)


if __name__ == "__main__":
    main()
