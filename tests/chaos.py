"""Chaos and fuzz run against a real `tandem serve` cluster: hostile bodies, then concurrent load
with client disconnects, KV connections reset at random and a decode worker (or, with
`--kill-role prefill`, a prefill worker) SIGKILLed mid-run.

It runs inside a network namespace of its own, so that the iptables rule resetting a share of the
KV port's packets touches nothing else (tests/test_chaos.py runs it so, at CI scale):

    unshare -n python tests/chaos.py               # CI scale: a few hundred requests
    unshare -n python tests/chaos.py --full        # 2,000 requests, concurrency 64
    python tests/chaos.py --device cuda --prefill-tp 2 --reference-device cuda:3 \
        "--engine-args=--dtype float32 --num-kv-blocks 4096" --reset-probability 0
                                                   # on four GPUs, KV over cuda-ipc

The cluster is a router, one prefill and two decode workers (`tandem serve`, cluster token and API
key set; `--prefill`, `--decode`, `--prefill-tp` and `--decode-tp` change the layout), beside a
`both` worker that gives the reference answers. Checks at the end: no request hung, no 5xx, every
complete answer token-identical to the reference, no stream that began with a 200 ended in an
error unless it was on the killed worker (at most the requests in flight then), the killed worker
back in the pool, every worker holding 0 KV blocks. Prints a JSON summary (and writes it to
--json) and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_bodies import hostile_bodies  # noqa: E402
from tiny_models import make_checkpoint  # noqa: E402
from worker_fixtures import parse_metrics  # noqa: E402

ROUTER_PORT, WORKER_PORT_BASE, KV_PORT_BASE, REFERENCE_PORT = 8000, 8100, 8200, 8300
API_KEY = "chaos-api-key"
REQUEST_TIMEOUT_S = 120.0  # a request still open after this counts as hung
VOCAB = 512  # the tiny checkpoints' vocabulary


@dataclass
class Outcomes:
    identical: int = 0
    corrupted: int = 0
    error_after_200: int = 0  # a stream that began with a 200 and ended in an error event
    refused: dict[str, int] = field(default_factory=dict)  # status -> count (4xx and 5xx)
    hung: int = 0
    disconnected: int = 0
    in_flight_at_kill: int = 0
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what[:300])


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def reset_kv_packets(port: int, probability: float) -> None:
    """Reset a share of the TCP packets to and from the KV port (both directions)."""
    sh("ip", "link", "set", "lo", "up")
    for direction in ("--dport", "--sport"):
        rule = f"-p tcp {direction} {port} -m statistic --mode random --probability {probability}"
        sh("iptables", "-A", "INPUT", *rule.split(), "-j", "REJECT", "--reject-with", "tcp-reset")


def packets_reset() -> int:
    lines = sh("iptables", "-L", "INPUT", "-v", "-n", "-x").splitlines()
    return sum(int(line.split()[0]) for line in lines if "REJECT" in line)


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: exited {process.returncode}\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} was not healthy in {timeout} s\n{log.read_text()[-3000:]}")


def pid_of_worker(port: int) -> int:
    """The pid of the `tandem worker` process listening on `port` (its API process)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"worker" in argv and b"--port" in argv and str(port).encode() in argv:
                return int(entry.name)
    raise LookupError(f"no worker process on port {port}")


def blocks_held(url: str) -> float:
    values = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return values.get("tandem_kv_cache_blocks_used", 0.0) + values.get(
        "tandem_kv_blocks_leased", 0.0
    )


def make_prompts(rng: random.Random, count: int) -> list[dict]:
    """Completion bodies over token-id prompts: greedy, a fixed number of tokens each."""
    bodies = []
    for _ in range(count):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 160))]
        bodies.append(
            {
                "model": "chaos",
                "prompt": prompt,
                "max_tokens": rng.randrange(2, 16),
                "temperature": 0.0,
                "return_token_ids": True,
            }
        )
    return bodies


async def reference_answers(url: str, bodies: list[dict]) -> list[list[int]]:
    answers = []
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for body in bodies:
            response = await client.post(url + "/v1/completions", json=body)
            response.raise_for_status()
            answers.append(response.json()["choices"][0]["token_ids"])
    return answers


async def one_request(
    client: httpx.AsyncClient,
    body: dict,
    expected: list[int],
    stream: bool,
    leave: bool,
    outcomes: Outcomes,
) -> None:
    """Send one request and file its outcome; `leave`: the client goes away part-way."""
    body = dict(body, stream=stream)
    url = f"http://127.0.0.1:{ROUTER_PORT}/v1/completions"
    if not stream:
        request = asyncio.ensure_future(client.post(url, json=body))
        if leave:
            await asyncio.sleep(random.random() * 0.2)
            request.cancel()
            outcomes.disconnected += 1
            return
        response = await request
        if response.status_code != 200:
            outcomes.refused[str(response.status_code)] = (
                outcomes.refused.get(str(response.status_code), 0) + 1
            )
            outcomes.note(f"{response.status_code}: {response.text}")
            return
        token_ids = response.json()["choices"][0].get("token_ids") or []
        file_answer(token_ids, expected, outcomes)
        return
    token_ids: list[int] = []
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            outcomes.refused[str(response.status_code)] = (
                outcomes.refused.get(str(response.status_code), 0) + 1
            )
            outcomes.note(f"{response.status_code}: {response.text}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                outcomes.error_after_200 += 1
                outcomes.note(f"error event: {line}")
                return
            for choice in chunk.get("choices") or []:
                token_ids += choice.get("token_ids") or []
            if leave:
                outcomes.disconnected += 1
                return  # closing the stream here is the client going away
    file_answer(token_ids, expected, outcomes)


def file_answer(token_ids: list[int], expected: list[int], outcomes: Outcomes) -> None:
    if token_ids == expected:
        outcomes.identical += 1
    else:
        outcomes.corrupted += 1
        outcomes.note(f"expected {expected}, got {token_ids}")


async def load(
    args: argparse.Namespace, bodies: list[dict], expected: list[list[int]], outcomes: Outcomes
) -> dict:
    """Run the requests at the given concurrency; SIGKILL the chosen worker (decode-0 or
    prefill-0) once a share of them is done."""
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(args.concurrency)
    done = 0
    in_flight = 0
    killed: dict = {}
    headers = {"authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:

        async def run(index: int) -> None:
            nonlocal done, in_flight
            choice = rng.randrange(len(bodies))
            stream, leave = rng.random() < 0.5, rng.random() < args.disconnects
            async with gate:
                in_flight += 1
                try:
                    await asyncio.wait_for(
                        one_request(
                            client, bodies[choice], expected[choice], stream, leave, outcomes
                        ),
                        REQUEST_TIMEOUT_S + 10,
                    )
                except (asyncio.TimeoutError, httpx.TimeoutException):
                    outcomes.hung += 1
                    outcomes.note(f"hung: request {index}")
                except httpx.HTTPError as exc:
                    outcomes.refused["connection"] = outcomes.refused.get("connection", 0) + 1
                    outcomes.note(f"connection: {exc!r}")
                finally:
                    in_flight -= 1
                    done += 1
                    if args.kill and not killed and done >= args.requests * 0.3:
                        pid = pid_of_worker(killed_port(args))
                        os.kill(pid, signal.SIGKILL)
                        killed.update(pid=pid, at_request=done)
                        outcomes.in_flight_at_kill = in_flight

        started = time.monotonic()
        await asyncio.gather(*(run(i) for i in range(args.requests)))
        elapsed = time.monotonic() - started
    return {"elapsed_s": round(elapsed, 1), "killed": killed}


def killed_port(args: argparse.Namespace) -> int:
    """The HTTP port of the worker the run kills (`tandem serve` numbers prefill workers first)."""
    return WORKER_PORT_BASE + (0 if args.kill_role == "prefill" else args.prefill)


def fuzz(args: argparse.Namespace, token: str) -> dict:
    """Hostile bodies at the router and straight at a decode worker: no 5xx, no hang."""
    targets = {
        "router": (f"http://127.0.0.1:{ROUTER_PORT}", {"authorization": f"Bearer {API_KEY}"}),
        "decode worker": (
            f"http://127.0.0.1:{WORKER_PORT_BASE + args.prefill + args.decode - 1}",  # the last
            {"authorization": f"Bearer {API_KEY}"},
        ),
    }
    for _, headers in targets.values():
        headers["content-type"] = "application/json"
    statuses: dict[str, int] = {}
    failures: list[str] = []
    with httpx.Client(timeout=60) as client:
        for name, (url, headers) in targets.items():
            for case, path, content in hostile_bodies(random.Random(args.seed), args.fuzz_cases):
                try:
                    response = client.post(url + path, content=content, headers=headers)
                except httpx.HTTPError as exc:
                    failures.append(f"{name} {case}: {exc!r}")
                    continue
                key = f"{response.status_code}"
                statuses[key] = statuses.get(key, 0) + 1
                if response.status_code >= 500:
                    failures.append(f"{name} {case}: {response.status_code} {response.text[:200]}")
    return {"statuses": statuses, "failures": failures[:20], "num_failures": len(failures)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="2,000 requests at concurrency 64")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnects", type=float, default=0.1, help="share of clients leaving")
    parser.add_argument(
        "--reset-probability",
        type=float,
        help="share of the KV port's packets answered with a TCP reset (default 0.01; --full:"
        " 0.0025; 0: no resets, no iptables)",
    )
    parser.add_argument(
        "--fuzz-cases",
        type=int,
        default=60,
        help="random mutations (beside the fixed hostile bodies)",
    )
    parser.add_argument("--no-kill", dest="kill", action="store_false")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument(
        "--kill-role", choices=["decode", "prefill"], default="decode", help="whose worker 0 dies"
    )
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="the cluster's: cpu, or cuda (its GPUs)")
    parser.add_argument("--reference-device", help="the reference worker's (default: --device)")
    parser.add_argument(
        "--engine-args", default="", help="more flags for every worker, e.g. '--dtype float32'"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="a checkpoint directory (default: a tiny random one)")
    parser.add_argument("--json", help="write the summary here too")
    args = parser.parse_args()
    if args.kill and getattr(args, args.kill_role) < 2:
        role = args.kill_role
        parser.error(f"killing {role}-0 leaves no {role} worker: add one (--{role} 2) or --no-kill")
    if args.full:
        args.requests, args.concurrency, args.fuzz_cases = 2000, 64, 1000
        if args.reset_probability is None:
            args.reset_probability = 0.0025  # about one transfer in twenty sees a reset
    if args.reset_probability is None:
        args.reset_probability = 0.01
    work = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    model = args.model or str(make_checkpoint("llama-gqa", work / "model"))
    if args.reset_probability > 0:
        reset_kv_packets(KV_PORT_BASE, args.reset_probability)

    token = secrets.token_urlsafe(16)
    env = dict(os.environ, TANDEM_API_KEY=API_KEY, TANDEM_CLUSTER_TOKEN=token)
    env.setdefault("OMP_NUM_THREADS", "1")
    python = [sys.executable, "-m", "tandem.cli"]
    serve = start(
        [
            *python,
            "serve",
            "--model",
            model,
            "--device",
            args.device,
            "--prefill",
            str(args.prefill),
            "--decode",
            str(args.decode),
            "--prefill-tp",
            str(args.prefill_tp),
            "--decode-tp",
            str(args.decode_tp),
            "--port",
            str(ROUTER_PORT),
            "--served-model-name",
            "chaos",
            *shlex.split(args.engine_args),
        ],
        work / "serve.log",
        env,
    )
    reference = start(
        [
            *python,
            "worker",
            "--model",
            model,
            "--role",
            "both",
            "--device",
            args.reference_device or args.device,
            "--port",
            str(REFERENCE_PORT),
            "--served-model-name",
            "chaos",
            *shlex.split(args.engine_args),
        ],
        work / "reference.log",
        dict(env, TANDEM_API_KEY="", TANDEM_CLUSTER_TOKEN=""),
    )
    summary: dict = {"requests": args.requests, "concurrency": args.concurrency, "logs": str(work)}
    try:
        wait_healthy(f"http://127.0.0.1:{REFERENCE_PORT}", reference, work / "reference.log")
        wait_healthy(f"http://127.0.0.1:{ROUTER_PORT}", serve, work / "serve.log")
        summary["fuzz"] = fuzz(args, token)
        bodies = make_prompts(random.Random(args.seed), 48)
        expected = asyncio.run(reference_answers(f"http://127.0.0.1:{REFERENCE_PORT}", bodies))
        outcomes = Outcomes()
        summary["load"] = asyncio.run(load(args, bodies, expected, outcomes))
        summary["outcomes"] = asdict(outcomes)
        summary["packets_reset"] = packets_reset() if args.reset_probability > 0 else 0
        urls = [
            f"http://127.0.0.1:{WORKER_PORT_BASE + i}" for i in range(args.prefill + args.decode)
        ]
        summary["killed_worker_back"] = wait_back(f"http://127.0.0.1:{killed_port(args)}", serve)
        summary["blocks_held"] = wait_blocks_free(urls + [f"http://127.0.0.1:{REFERENCE_PORT}"])
        summary["serve_alive"] = serve.poll() is None
    finally:
        for process in (serve, reference):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT if process is serve else signal.SIGTERM)
        for process in (serve, reference):
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    failed = checks(summary, args)
    summary["failed_checks"] = failed
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


def wait_back(url: str, serve: subprocess.Popen, timeout: float = 120) -> bool:
    """Whether the killed worker answers /health again (the launcher restarted it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and serve.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        time.sleep(0.5)
    return False


def wait_blocks_free(urls: list[str], timeout: float = 60) -> dict[str, float]:
    """Each worker's KV blocks held (used or leased) once all reach 0, or at the timeout (leases
    of a killed decode worker's transfers end with their lease, 30 s)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {}
        for url in urls:
            try:
                held[url] = blocks_held(url)
            except httpx.HTTPError:
                held[url] = -1.0
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def checks(summary: dict, args: argparse.Namespace) -> list[str]:
    failed = []
    fuzz_result = summary.get("fuzz", {})
    if fuzz_result.get("num_failures"):
        failed.append(f"fuzz: {fuzz_result['num_failures']} bodies got a 5xx or no answer")
    outcomes = summary.get("outcomes")
    if outcomes is None:
        return failed + ["the load did not run"]
    if outcomes["hung"]:
        failed.append(f"{outcomes['hung']} requests hung")
    server_errors = {k: v for k, v in outcomes["refused"].items() if not k.startswith("4")}
    if server_errors:
        failed.append(f"answers other than 200/4xx: {server_errors}")
    if outcomes["corrupted"]:
        failed.append(f"{outcomes['corrupted']} answers differ from the colocated worker's")
    allowed = outcomes["in_flight_at_kill"] if args.kill else 0
    if outcomes["error_after_200"] > allowed:
        failed.append(
            f"{outcomes['error_after_200']} streams ended in an error (allowed {allowed})"
        )
    if args.kill and not summary.get("killed_worker_back"):
        failed.append("the killed decode worker did not come back")
    if any(summary.get("blocks_held", {"?": 1}).values()):
        failed.append(f"KV blocks still held: {summary.get('blocks_held')}")
    if not summary.get("serve_alive"):
        failed.append("tandem serve stopped")
    if args.reset_probability > 0 and not summary.get("packets_reset"):
        failed.append("no KV packet was reset: the fault did not reach the KV port")
    return failed


if __name__ == "__main__":
    sys.exit(main())
