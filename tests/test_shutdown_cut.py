"""How an answer that a server's shutdown deadline cuts ends (`tandem.shutdown_cut`): the ASGI
apps the router and a worker answer with (the router's `RelayResponse`, Starlette's streaming
and JSON responses), wrapped as each server wraps them, their task cancelled as uvicorn cancels
it, in this process; then a real worker SIGTERMed while it streams (slow: its 10 s grace)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from msgspec.json import encode
from starlette.responses import JSONResponse, StreamingResponse

from process_tree import SRC, alive, descendants, tandem_process
from tandem.router.cli import SHUTTING_DOWN as ROUTER_CUT
from tandem.router.relay import JSON_HEAD, SSE_HEAD, RelayResponse, ResponseHead
from tandem.router.relay import error_body as router_error_body
from tandem.server.main import GRACEFUL_SHUTDOWN_S
from tandem.server.main import SHUTTING_DOWN as WORKER_CUT
from tandem.server.openai.protocol import error_body
from tandem.shutdown_cut import EndCutAnswers
from worker_fixtures import free_port, sse_payloads_across_a_sigterm, start_worker

HTTP_SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
# A 20 s stream of the tiny model: the fault plug-in sleeps 20 ms in each step of this prompt.
PLUGINS = Path(__file__).resolve().parent / "fault_plugins"
SLOW_TOKEN = 505
SLOW_FAULT = {"TANDEM_TEST_FAULT": f"slow:{SLOW_TOKEN}"}
SLOW_STREAM = {
    "prompt": [SLOW_TOKEN, 1, 2, 3],
    "max_tokens": 1000,
    "stream": True,
    "return_token_ids": True,
}


def cut(app, error: bytes, sent_before_cut: int, client_leaves: bool = False) -> list[dict]:
    """What `EndCutAnswers(app, error)` (an error body) sends after its task is cancelled once
    the app has sent `sent_before_cut` messages (the client stays, or left just before)."""

    async def run() -> list[dict]:
        sent: list[dict] = []
        left = asyncio.Event()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        task = asyncio.create_task(EndCutAnswers(app, error)(HTTP_SCOPE, receive, send))
        await asyncio.sleep(0.05)
        assert len(sent) == sent_before_cut, sent
        if client_leaves:
            left.set()
            await asyncio.sleep(0.05)
        task.cancel()
        await task  # ended, not failed: the server logs no error
        return sent[sent_before_cut:]

    return asyncio.run(run())


def relay(head: ResponseHead | None, closed: list[bool]) -> RelayResponse:
    """The router's response over a flow that waits for ever after `head` and one chunk (or
    before any head: None); `closed` gets True once the flow's cleanup ran."""

    async def flow():
        try:
            if head is not None:
                yield head
                yield b"data: {}\n\n" if head is SSE_HEAD else b'{"partial'
            await asyncio.Event().wait()
            yield b"never"
        finally:
            closed.append(True)

    return RelayResponse(flow())


async def waits_after_one_event() -> AsyncIterator[str]:
    yield "data: {}\n\n"
    await asyncio.Event().wait()


def ended_stream(last: dict) -> dict:
    """The error of an ending sent as a stream's last body: an error event, then [DONE]."""
    assert last["type"] == "http.response.body" and not last.get("more_body", False)
    error, done = last["body"].split(b"\n\n")[:2]
    assert done == b"data: [DONE]"
    return json.loads(error.removeprefix(b"data: "))["error"]


def ended_before_head(ending: list[dict]) -> dict:
    start, body = ending
    assert start["type"] == "http.response.start" and start["status"] == 503
    assert not body.get("more_body", False)
    return json.loads(body["body"])["error"]


def test_the_routers_cut_answers_end_in_words_and_its_flows_clean_up():
    closed: list[bool] = []
    router_cut = router_error_body(ROUTER_CUT, "server_error", "router_shutting_down")
    (last,) = cut(relay(SSE_HEAD, closed), router_cut, 2)
    assert ended_stream(last)["code"] == "router_shutting_down"
    error = ended_before_head(cut(relay(None, closed), router_cut, 0))
    assert error["code"] == "router_shutting_down" and "retry" in error["message"]
    assert cut(relay(JSON_HEAD, closed), router_cut, 2) == []  # a half-sent JSON: left cut
    assert closed == [True] * 3  # every flow's cleanup ran (it aborts the legs)


def test_a_workers_cut_stream_ends_with_an_error_event():
    """Starlette's streaming response, as a worker's SSE answer (its disconnect listener in a
    task group under ASGI 2.3, uvicorn's)."""
    worker_error = error_body(WORKER_CUT, 503)["error"]
    stream = StreamingResponse(waits_after_one_event(), media_type="text/event-stream")
    (last,) = cut(stream, encode({"error": worker_error}), 2)
    assert ended_stream(last) == worker_error
    assert worker_error["code"] == 503 and "retry" in worker_error["message"]


async def never() -> None:
    await asyncio.Event().wait()


def endpoint(wait: Callable[[], object]):
    """An app that answers once `wait()` returns: a worker's whole answer, still generating."""

    async def app(scope, receive, send) -> None:
        await wait()
        await JSONResponse({})(scope, receive, send)

    return app


def test_a_workers_answer_not_begun_is_a_503_and_a_client_gone_gets_nothing():
    worker_error = error_body(WORKER_CUT, 503)["error"]
    worker_cut = encode({"error": worker_error})
    assert ended_before_head(cut(endpoint(never), worker_cut, 0)) == worker_error
    stream = StreamingResponse(waits_after_one_event(), media_type="text/event-stream")
    assert cut(stream, worker_cut, 2, client_leaves=True) == []


@pytest.mark.slow  # the worker's 10 s graceful shutdown; the ends themselves are tested above
def test_a_stream_still_running_when_its_worker_stops_ends_with_an_error_event(
    tiny_checkpoints, tmp_path
):
    """SIGTERM to a worker streaming a 20 s answer (the fault plug-in's slow prompt, 20 ms a
    step): after its 10 s grace the stream ends with the error event and [DONE], and the worker
    exits 0 with no traceback in its log."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(PLUGINS))
        for name, value in SLOW_FAULT.items():
            patch.setenv(name, value)
        worker = start_worker(tmp_path, model=str(tiny_checkpoints["llama-gqa"]))
    try:
        worker.wait_healthy()
        url = worker.url + "/v1/completions"
        wait_s = GRACEFUL_SHUTDOWN_S + 20
        payloads = sse_payloads_across_a_sigterm(url, SLOW_STREAM, worker.process, wait_s)
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"]["message"] == WORKER_CUT, payloads[-2]
        assert worker.process.wait(timeout=30) == 0
        assert "Traceback" not in worker.log_tail(100_000)
    finally:
        worker.stop()


@pytest.mark.slow  # about 35 s: the router's 10 s grace, then the worker's
def test_a_stream_from_a_worker_of_tandem_serve_ends_in_words_when_serve_stops(
    tiny_checkpoints, tmp_path
):
    """Ctrl-C to `tandem serve` (its default --stop-timeout) while a client streams a 20 s
    answer straight from its decode worker (the fault plug-in's slow prompt): the router stops
    first, then the worker's grace runs out and the stream ends with its error event and [DONE]
    (with the old 10 s stop timeout the launcher's SIGKILL came first and broke it); the
    launcher exits 0 and no process is left."""
    env = {"PYTHONPATH": os.pathsep.join([str(SRC), str(PLUGINS)]), **SLOW_FAULT}
    model, port, log = str(tiny_checkpoints["llama-gqa"]), free_port(), tmp_path / "serve.log"
    args = ("serve", "--model", model, "--port", str(port), "--device", "cpu")
    launcher = tandem_process(log, *args, env=env)
    try:
        deadline = time.monotonic() + 120
        while "tandem serve: ready" not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        (decode_url,) = re.findall(r"worker ready on (\S+) \(role decode\)", log.read_text())
        children = descendants(launcher.pid)
        url, wait_s = decode_url + "/v1/completions", 2 * GRACEFUL_SHUTDOWN_S + 20
        payloads = sse_payloads_across_a_sigterm(url, SLOW_STREAM, launcher, wait_s, signal.SIGINT)
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"]["message"] == WORKER_CUT, payloads[-2]
        assert launcher.wait(timeout=60) == 0
        assert not any(alive(pid) for pid in children)
        assert "Traceback" not in log.read_text()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
