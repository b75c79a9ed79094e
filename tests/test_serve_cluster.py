"""The real PD system end to end: `tandem serve` on the default model behind the official openai
client, compared with a colocated worker, also over a pd server alone; a decode worker killed
mid-stream behind the router; a decode worker of `tandem serve` SIGKILLed and restarted; Ctrl-C
on `tandem serve` leaving no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from process_tree import alive, descendants, tandem_process
from worker_fixtures import DEFAULT_MODEL, free_port, running_worker, start_worker

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{what} did not happen within {timeout} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`tandem serve` (1 prefill + 1 decode, CPU) and a colocated worker to compare with."""
    logs = tmp_path_factory.mktemp("serve")
    port = free_port()
    launcher = tandem_process(logs / "serve.log", "serve", "--port", str(port), "--device", "cpu")
    reference = start_worker(logs)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 300, "tandem serve")
        reference.wait_healthy()
        yield {"url": url, "launcher": launcher, "reference": reference, "logs": logs}
    finally:
        reference.stop()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_openai_client_through_serve_matches_colocated(cluster):
    pd = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="unused")
    both = openai.OpenAI(base_url=cluster["reference"].url + "/v1", api_key="unused")
    chat = dict(model=DEFAULT_MODEL, messages=CHAT, temperature=0, max_tokens=20)
    answers = [c.chat.completions.create(**chat) for c in (pd, both)]
    assert "Paris" in answers[0].choices[0].message.content
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.completion_tokens == answers[1].usage.completion_tokens
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in pd.chat.completions.create(**chat, stream=True)
        if chunk.choices
    )
    assert streamed == answers[1].choices[0].message.content

    completion = dict(
        model=DEFAULT_MODEL,
        prompt="Once upon a time, there was a little",
        max_tokens=16,
        temperature=0.8,
        seed=11,
    )
    expected = both.completions.create(**completion).choices[0].text
    assert pd.completions.create(**completion).choices[0].text == expected
    chunks = list(pd.completions.create(**completion, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_structured_output_through_serve_matches_colocated(cluster):
    """Streamed through the router, a request is handed off: the decode worker follows the
    prefill worker's first token with its own grammar."""
    pd = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="unused")
    both = openai.OpenAI(base_url=cluster["reference"].url + "/v1", api_key="unused")
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 16}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    chat = dict(
        model=DEFAULT_MODEL,
        messages=CHAT,
        temperature=0,
        max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    expected = both.chat.completions.create(**chat).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in pd.chat.completions.create(**chat, stream=True)
        if chunk.choices
    )
    assert streamed == expected and isinstance(json.loads(expected), dict)


def test_auto_tool_choice_needs_a_parser(cluster):
    """Workers started without --enable-auto-tool-choice refuse tool_choice "auto" (the
    default with tools) with a 400 that names the flags; the router relays it."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    for tool_choice in (None, "auto"):
        body = {"model": DEFAULT_MODEL, "messages": CHAT, "tools": tools}
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        answer = httpx.post(f"{cluster['url']}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "--enable-auto-tool-choice" in error["message"]
        assert error["param"] == "tool_choice"


def test_tokenize_and_detokenize_through_the_router_match_a_worker(cluster):
    requests = [
        ("/tokenize", {"prompt": "Once upon a time", "return_token_strs": True}),
        ("/tokenize", {"messages": CHAT}),
        ("/detokenize", {"tokens": [7, 1234, 890]}),
        ("/detokenize", {"tokens": [10**9]}),  # a 400, relayed unchanged
    ]
    for path, body in requests:
        routed = httpx.post(cluster["url"] + path, json=body, timeout=30)
        direct = httpx.post(cluster["reference"].url + path, json=body, timeout=30)
        assert (routed.status_code, routed.json()) == (direct.status_code, direct.json()), path
    assert routed.status_code == 400


@pytest.mark.slow  # 11 s; 32 concurrent PD requests run by default (tests/test_pd_tiny.py)
def test_64_concurrent_streams_complete(cluster):
    async def run() -> list[tuple[str, str | None]]:
        client = openai.AsyncOpenAI(base_url=cluster["url"] + "/v1", api_key="unused")

        async def one(index: int) -> tuple[str, str | None]:
            stream = await client.completions.create(
                model=DEFAULT_MODEL,
                prompt=f"Story number {index}: once upon a time",
                max_tokens=6,
                temperature=0.7,
                seed=index,
                stream=True,
            )
            text, finish = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
            return text, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(text and finish in ("length", "stop") for text, finish in results)


@pytest.mark.slow  # 39 s, a second cluster; the pd server itself: tests/test_pd_one_server.py
def test_serve_pd_servers_alone_match_colocated(cluster, tmp_path):
    """`tandem serve --prefill 0 --decode 0 --pd 1`: the router over one pd server (a prefill
    and a decode engine behind one API server) as a colocated worker answers as the colocated
    worker does, and Ctrl-C leaves no process."""
    port = free_port()
    launcher = tandem_process(
        tmp_path / "serve-pd.log", "serve", "--port", str(port), "--device", "cpu",
        "--prefill", "0", "--decode", "0", "--pd", "1",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        served = {"prefill": 0, "decode": 0, "both": 1}
        health = lambda: httpx.get(f"{url}/health").json().get("workers") == served  # noqa: E731
        wait_until(health, 300, "tandem serve --pd 1")
        body = {"model": DEFAULT_MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 20}
        answers = [
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()
            for base in (url, cluster["reference"].url)
        ]
        texts = [answer["choices"][0]["message"]["content"] for answer in answers]
        assert "Paris" in texts[0] and texts[0] == texts[1]
        children = descendants(launcher.pid)
        assert len(children) >= 4  # the router, the pd server and its two engine cores
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 0
        wait_until(lambda: not any(alive(pid) for pid in children), 10, "every child exiting")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def decode_worker_of(launcher_pid: int) -> int:
    """The pid of the launcher's one decode worker."""
    children = {
        int(child)
        for task in Path(f"/proc/{launcher_pid}/task").glob("*/children")
        for child in task.read_text().split()
    }
    (decode,) = [
        pid for pid in children if b"--role\0decode\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    return decode


@pytest.mark.slow  # 11 s; test_launcher_serve.py restarts a crashed worker by default
def test_a_killed_decode_worker_comes_back(cluster):
    """As the OOM killer would: SIGKILL the decode worker of `tandem serve`. The launcher
    restarts it on its ports (it used to stop the whole cluster), the worker's engine core dies
    with it, and the router takes the new worker into its pool and answers through it."""
    launcher, url = cluster["launcher"], cluster["url"]
    log = cluster["logs"] / "serve.log"
    decode = decode_worker_of(launcher.pid)
    old_group = descendants(decode) | {decode}
    os.kill(decode, signal.SIGKILL)
    restarting = "decode-0 exited with code -9; restarting in 1 s (restart 1)"
    wait_until(lambda: restarting in log.read_text(), 30, "the restart line")
    wait_until(lambda: not any(alive(pid) for pid in old_group), 10, "the old worker's exit")

    def decode_in_pool() -> bool:
        return httpx.get(f"{url}/health").json()["workers"]["decode"] == 1

    wait_until(lambda: "decode-0 is healthy again" in log.read_text(), 300, "the new worker")
    wait_until(decode_in_pool, 30, "the router taking the worker back")
    assert launcher.poll() is None
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=CHAT, temperature=0, max_tokens=20
    )
    assert "Paris" in answer.choices[0].message.content
    new_decode = decode_worker_of(launcher.pid)
    assert new_decode not in old_group


def test_ctrl_c_on_serve_leaves_no_process(cluster):
    """Also after a restart (the test above): the new worker and its engine core go too."""
    launcher = cluster["launcher"]
    children = descendants(launcher.pid)
    assert len(children) >= 5  # router, two workers, two engine cores
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) == 0
    wait_until(lambda: not any(alive(pid) for pid in children), 10, "every child exiting")


@pytest.mark.slow  # 25 s; by default: test_a_killed_decode_worker_comes_back (the restart) and
# test_pd_failures' killed decode worker (the client's side)
def test_killing_a_real_decode_worker_mid_stream(tmp_path, tiny_checkpoints):
    """Streams through the router end with an error event when their decode worker dies; new
    requests succeed once a decode worker is back on the same address."""
    model = str(tiny_checkpoints["llama-gqa"])
    decode_port, router_port = free_port(), free_port()
    # One sequence at a time: while the first stream decodes, the others wait for admission, so
    # some stream is still open when the worker dies however fast the tiny model generates.
    decode_flags = ("--role", "decode", "--max-num-seqs", "1")
    with running_worker(tmp_path, "--role", "prefill", model=model) as prefill:
        decode = start_worker(tmp_path, *decode_flags, model=model, port=decode_port)
        decode.wait_healthy()
        router = tandem_process(
            tmp_path / "router.log", "router", "--port", str(router_port),
            "--prefill", prefill.url, "--decode", decode.url, "--health-interval", "0.2",
        )  # fmt: skip
        router_url = f"http://127.0.0.1:{router_port}"
        try:
            wait_until(lambda: httpx.get(f"{router_url}/health").status_code == 200, 60, "router")
            body = {"prompt": [1, 2, 3, 4], "max_tokens": 1000, "ignore_eos": True, "stream": True}
            events: list[list] = [[] for _ in range(3)]
            ended_at = [float("inf")] * len(events)
            started = threading.Event()  # a first stream is under way

            def read(index: int) -> None:
                url = f"{router_url}/v1/completions"
                with httpx.stream("POST", url, json=body, timeout=60) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            data = line[6:]
                            events[index].append(data if data == "[DONE]" else json.loads(data))
                            if len(events[index]) >= 3:
                                started.set()
                ended_at[index] = time.monotonic()

            readers = [threading.Thread(target=read, args=(i,)) for i in range(len(events))]
            for reader in readers:
                reader.start()
            assert started.wait(60), "the streams did not start"
            killed_at = time.monotonic()
            os.killpg(decode.process.pid, signal.SIGKILL)
            for reader in readers:
                reader.join(timeout=20)
            assert not any(reader.is_alive() for reader in readers), "a stream hung"
            assert all(stream[-1] == "[DONE]" for stream in events)
            # A stream either had every token before the kill or ends with an error event.
            finished = [s for s in events if s[-2].get("choices", [{}])[0].get("finish_reason")]
            cut = [stream for stream in events if stream not in finished]
            assert cut, "every stream finished before the kill; nothing was tested"
            assert all("error" in stream[-2] for stream in cut), [s[-2] for s in cut]
            assert all(end - killed_at < 10 for end in ended_at)  # none waited for a timeout

            replacement = start_worker(tmp_path, *decode_flags, model=model, port=decode_port)
            try:
                replacement.wait_healthy()
                wait_until(
                    lambda: httpx.get(f"{router_url}/health").status_code == 200, 30, "rejoin"
                )
                answer = httpx.post(
                    f"{router_url}/v1/completions",
                    json={"prompt": [1, 2, 3, 4], "max_tokens": 5, "return_token_ids": True},
                    timeout=60,
                )
                assert answer.status_code == 200
                assert len(answer.json()["choices"][0]["token_ids"]) == 5
            finally:
                replacement.stop()
        finally:
            os.killpg(router.pid, signal.SIGKILL)
            router.wait()
            decode.stop()
