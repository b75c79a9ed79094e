"""The worker under admission limits and at shutdown, on a real `tandem worker` (CPU) started with
one running slot and one waiting slot (`--max-num-seqs 1 --max-waiting 1`).

A request beyond the waiting queue gets a 503 error object and the server recovers once the queue
drains. SIGTERM to the worker's process group (as tandem serve and Slurm send it) while a response
streams: the listening socket closes, the in-flight stream still completes (the engine core does
not stop on the signal, its API process stops it), and the process exits 0. The SIGTERM test
stops this module's worker, so it runs after the tests that use it. A worker killed outright
leaves no engine core behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from worker_fixtures import running_worker, start_worker, wait_for_metric

LIMIT_FLAGS = ("--max-num-seqs", "1", "--max-waiting", "1")
EXIT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with running_worker(tmp_path_factory.mktemp("worker"), *LIMIT_FLAGS) as process:
        yield process


def completion(max_tokens: int, stream: bool = False) -> dict:
    return {
        "prompt": "Count with me: one, two, three,",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


async def test_a_full_waiting_queue_answers_503_and_recovers(worker):
    url = worker.url
    async with httpx.AsyncClient(timeout=120) as http:
        # Samples wait one by one: n over the queue's size can never be admitted.
        too_many = await http.post(f"{url}/v1/completions", json=dict(completion(2), n=2))
        assert too_many.status_code == 400
        message = too_many.json()["error"]["message"]
        assert "more than this worker's queue holds (1, --max-waiting)" in message
        async with http.stream("POST", f"{url}/v1/completions", json=completion(4000, True)) as run:
            assert run.status_code == 200
            lines = run.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            # The one running slot is taken; the next request fills the one waiting slot.
            queued = asyncio.create_task(http.post(f"{url}/v1/completions", json=completion(3)))
            assert await asyncio.to_thread(wait_for_metric, url, "tandem_requests_waiting", 1) == 1

            for endpoint, body in [
                ("/v1/completions", completion(3)),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ]:
                refused = await http.post(url + endpoint, json=body)
                assert refused.status_code == 503, refused.text
                error = refused.json()["error"]
                assert (error["code"], error["type"]) == (503, "service_unavailable")
                assert "retry" in error["message"]
            assert not queued.done()
        # The streaming client left: its request is aborted and the queued one runs.
        answer = await asyncio.wait_for(queued, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
        again = await http.post(f"{url}/v1/completions", json=completion(2))
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2
    assert wait_for_metric(url, "tandem_kv_cache_blocks_used", 0) == 0


def connection_refused(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False


def test_sigterm_stops_accepting_finishes_the_stream_and_exits_zero(worker):
    num_tokens = 8  # finishes well within the 10 s grace period even on a busy CPU
    token_ids, finish_reasons, done = [], [], False
    body = dict(completion(num_tokens, stream=True), return_token_ids=True)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{worker.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            os.killpg(worker.process.pid, signal.SIGTERM)  # the group, as a supervisor does
            deadline = time.monotonic() + 5
            while not connection_refused(worker.port):
                assert time.monotonic() < deadline, "the worker still accepts connections"
                time.sleep(0.05)
            for line in [first, *lines]:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    (choice,) = json.loads(line.removeprefix("data: "))["choices"]
                    token_ids += choice["token_ids"]
                    finish_reasons.append(choice["finish_reason"])
    assert done and finish_reasons[-1] == "length", worker.log_tail()
    assert len(token_ids) == num_tokens
    try:
        code = worker.process.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within {EXIT_TIMEOUT_S} s of SIGTERM")
    assert code == 0, worker.log_tail()
    assert "Traceback" not in worker.log_tail(20000)
    assert process_group_is_empty(worker.process.pid), "the engine core outlived the worker"


def process_group_is_empty(group_id: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group_id, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_the_engine_stops_when_its_api_process_is_killed(tmp_path, tiny_checkpoints):
    """A worker killed outright (no shutdown message reaches its engine core) leaves nothing
    running: the engine finds its parent gone and stops."""
    worker = start_worker(
        tmp_path, "--num-kv-blocks", "64", model=str(tiny_checkpoints["llama-gqa"])
    )
    try:
        worker.wait_healthy()
        answer = httpx.post(
            f"{worker.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}
        )
        assert answer.status_code == 200
        worker.process.kill()
        worker.process.wait(timeout=EXIT_TIMEOUT_S)
        assert process_group_is_empty(worker.process.pid), "the engine core outlived its worker"
    finally:
        worker.stop()
