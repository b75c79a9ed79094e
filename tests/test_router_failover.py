"""A decode worker killed while requests stream through `tandem router`, a prefill worker
killed while it prefills, and the router stopped while it answers, in real processes; and how a
response the router's server cuts at its shutdown deadline ends.

The workers are fake (tests/fake_worker.py: the completion of "a b" is " a b a b ...");
the router is the real command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import tandem
from worker_fixtures import free_port, sse_payloads_across_a_sigterm

SRC = str(Path(tandem.__file__).resolve().parents[1])
TESTS = Path(__file__).resolve().parent  # fake_worker.py


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(SRC), str(TESTS))))

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(
            [sys.executable, "-m", *args], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()


def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def both_workers_healthy(client: httpx.Client, router_url: str) -> bool:
    workers = client.get(router_url + "/health").json()["workers"]
    return workers["prefill"] == 1 and workers["decode"] == 1


def spawn_router(
    spawn, router_port: int, prefill_port: int, decode_port: int
) -> tuple[str, subprocess.Popen[bytes]]:
    """`tandem router` over one prefill and one decode worker: its URL and process."""
    router = spawn("router", "tandem.cli", "router", "--port", str(router_port), "--prefill",
                   f"http://127.0.0.1:{prefill_port}", "--decode",
                   f"http://127.0.0.1:{decode_port}", "--health-interval", "0.2")  # fmt: skip
    return f"http://127.0.0.1:{router_port}", router


def kill_and_join(process: subprocess.Popen[bytes], clients: list[threading.Thread]) -> None:
    """SIGKILL the worker: every client thread ends within 5 s of it."""
    process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for client in clients:
        client.join(timeout=10)
    assert not any(client.is_alive() for client in clients), "a request hung"
    assert time.monotonic() - killed_at < 5


def test_killing_the_decode_worker_mid_stream(spawn):
    prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
    fake = ("fake_worker", "--host", "127.0.0.1")
    spawn("prefill", *fake, "--role", "prefill", "--port", str(prefill_port))
    decode_args = (*fake, "--role", "decode", "--port", str(decode_port), "--token-delay", "0.05")
    decode = spawn("decode", *decode_args)
    router_url, _ = spawn_router(spawn, router_port, prefill_port, decode_port)
    client = httpx.Client(timeout=10)
    # Both workers in the pool, not just the decode worker (/health is 200 with that alone, and
    # the streams would then run on it as plain requests).
    wait_for(lambda: both_workers_healthy(client, router_url), timeout=20)

    body = {"prompt": "a b", "max_tokens": 200, "stream": True}
    streams: list[list[object]] = [[] for _ in range(4)]
    started = [threading.Event() for _ in streams]

    def read_stream(index: int) -> None:
        with client.stream("POST", router_url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    streams[index].append(data if data == "[DONE]" else json.loads(data))
                    if len(streams[index]) == 3:
                        started[index].set()

    readers = [threading.Thread(target=read_stream, args=(i,)) for i in range(len(streams))]
    for reader in readers:
        reader.start()
    for event in started:
        assert event.wait(timeout=10), "the streams did not start"
    kill_and_join(decode, readers)

    for payloads in streams:
        assert payloads[-1] == "[DONE]"
        error = payloads[-2]["error"]
        assert "decode worker" in error["message"] and "failed mid-stream" in error["message"]
        text = "".join(chunk["choices"][0]["text"] for chunk in payloads[:-2])
        assert len(text) > 4 and (" a b" * 200).startswith(text)

    asked_at = time.monotonic()
    refused = client.post(router_url + "/v1/completions", json=dict(body, stream=False))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker"
    assert time.monotonic() - asked_at < 3

    prefill_stats = f"http://127.0.0.1:{prefill_port}/fake/stats"
    # Every lease of a request whose decode leg failed was released: 4 streams + 1 refusal.
    wait_for(lambda: len(client.get(prefill_stats).json()["released"]) == 5, timeout=5)

    spawn("decode-again", *decode_args)
    wait_for(lambda: both_workers_healthy(client, router_url), timeout=20)
    answer = client.post(router_url + "/v1/completions", json={"prompt": "a b", "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " a b a"
    client.close()


def test_a_prefill_worker_killed_mid_prefill_leaves_the_request_to_the_decode_worker(spawn):
    """The prefill worker dies while it holds the prefill legs (nothing reached the clients):
    each request, streamed or not, goes whole to the decode worker, and the router counts it
    so."""
    prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
    fake = ("fake_worker", "--host", "127.0.0.1")
    prefill_args = (*fake, "--role", "prefill", "--port", str(prefill_port))
    prefill = spawn("prefill", *prefill_args, "--prefill-delay", "30")
    spawn("decode", *fake, "--role", "decode", "--port", str(decode_port))
    router_url, _ = spawn_router(spawn, router_port, prefill_port, decode_port)
    client = httpx.Client(timeout=20)
    wait_for(lambda: both_workers_healthy(client, router_url), timeout=20)

    body = {"prompt": "a b", "max_tokens": 5}
    answers: dict[bool, httpx.Response] = {}

    def ask(streamed: bool) -> None:
        answers[streamed] = client.post(
            router_url + "/v1/completions", json=dict(body, stream=streamed)
        )

    askers = [threading.Thread(target=ask, args=(streamed,)) for streamed in (False, True)]
    for asker in askers:
        asker.start()
    prefill_stats = f"http://127.0.0.1:{prefill_port}/fake/stats"
    wait_for(lambda: len(client.get(prefill_stats).json()["requests"]) == 2, timeout=10)
    kill_and_join(prefill, askers)

    whole = answers[False]
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == " a b a b a"
    streamed = answers[True]
    assert streamed.status_code == 200, streamed.text
    payloads = [line[len("data: ") :] for line in streamed.text.splitlines()
                if line.startswith("data: ")]  # fmt: skip
    assert payloads[-1] == "[DONE]"
    text = "".join(json.loads(data)["choices"][0]["text"] for data in payloads[:-1])
    assert text == " a b a b a"
    decode_stats = client.get(f"http://127.0.0.1:{decode_port}/fake/stats").json()
    kinds = [request["kind"] for request in decode_stats["requests"]]
    assert kinds == ["plain", "plain"], kinds
    metrics = client.get(router_url + "/metrics").text
    counted = 'tandem_router_pd_decisions_total{decision="whole",reason="prefill_failed"} 2.0'
    assert counted in metrics
    client.close()


# ---- a response cut by the server's shutdown deadline (its ends: test_shutdown_cut.py) ------


@pytest.mark.slow  # 12 s: the router's 10 s graceful shutdown; the cut's ends are tested above
def test_streams_still_running_when_the_router_stops_end_with_an_error_event(spawn):
    """SIGTERM to `tandem router` while a stream runs (a slow decode): after the 10 s graceful
    shutdown, the stream ends with the error event and [DONE], and the router exits."""
    prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
    fake = ("fake_worker", "--host", "127.0.0.1")
    spawn("prefill", *fake, "--role", "prefill", "--port", str(prefill_port))
    decode_args = (*fake, "--role", "decode", "--port", str(decode_port), "--token-delay", "0.05")
    spawn("decode", *decode_args)
    router_url, router = spawn_router(spawn, router_port, prefill_port, decode_port)
    client = httpx.Client(timeout=30)
    wait_for(lambda: both_workers_healthy(client, router_url), timeout=20)
    body = {"prompt": "a b", "max_tokens": 1000, "stream": True}
    payloads = sse_payloads_across_a_sigterm(router_url + "/v1/completions", body, router, 20)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "router_shutting_down"
    router.wait(timeout=10)
    client.close()
