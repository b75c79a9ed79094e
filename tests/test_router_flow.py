"""The router against fake workers (tests/fake_worker.py) served in threads.

The fake model echoes the prompt's words, so every expected completion here is worked out by
hand: "a b c" with max_tokens=5 completes to " a b c a b".
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import uvicorn

import fuzz_bodies
import tandem
from fake_worker import FakeControl, FakeStats, create_fake_worker
from tandem.router.app import create_app
from tandem.router.config import RouterConfig
from tandem.router.registration import HeartbeatSender
from worker_fixtures import free_port

MODEL = "fake-model"
# One client for the module: making an httpx.Client (its TLS context) costs tens of ms.
HTTP = httpx.Client(timeout=10)


class ThreadServer:
    """An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def stop_all(servers: list[ThreadServer]) -> None:
    for server in servers:
        server.server.should_exit = True
    for server in servers:
        server.thread.join(timeout=10)


@dataclass
class Fake:
    server: ThreadServer
    control: FakeControl
    stats: FakeStats

    @property
    def url(self) -> str:
        return self.server.url

    def kinds(self) -> list[str]:
        return [request["kind"] for request in self.stats.requests]


@dataclass
class Cluster:
    router: ThreadServer
    prefill: list[Fake]
    decode: list[Fake]
    both: list[Fake]
    servers: list[ThreadServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def pool(self) -> Any:
        return self.router.app.state.pool


def start_fake(role: str, api_key: str | None = None) -> Fake:
    control = FakeControl()
    app = create_fake_worker(role, MODEL, control, api_key)
    return Fake(ThreadServer(app).start(), control, app.state.stats)


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    servers: list[ThreadServer] = []

    def make(
        prefill: int = 1,
        decode: int = 1,
        both: int = 0,
        worker_api_key: str | None = None,
        **settings: Any,
    ) -> Cluster:
        fakes = {
            role: [start_fake(role, worker_api_key) for _ in range(n)]
            for role, n in (("prefill", prefill), ("decode", decode), ("both", both))
        }
        for group in fakes.values():
            servers.extend(fake.server for fake in group)
        settings.setdefault("health_interval_s", 0.1)
        config = RouterConfig(
            prefill_urls=tuple(fake.url for fake in fakes["prefill"]),
            decode_urls=tuple(fake.url for fake in fakes["decode"]),
            both_urls=tuple(fake.url for fake in fakes["both"]),
            **settings,
        )
        router = ThreadServer(create_app(config)).start()
        servers.append(router)
        return Cluster(router, fakes["prefill"], fakes["decode"], fakes["both"])

    yield make
    stop_all(servers)


def sse_payloads(response: httpx.Response) -> list[Any]:
    """The data payloads of a streamed response: parsed JSON, or the string "[DONE]"."""
    payloads = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    with HTTP.stream("POST", url + path, json=dict(body, stream=True)) as response:
        assert response.status_code == 200, response.read()
        return sse_payloads(response)


def completion_text(payloads: list[Any]) -> str:
    return "".join(c["choices"][0]["text"] for c in payloads[:-1] if c.get("choices"))


def metric_samples(url: str) -> dict[str, float]:
    """The router's /metrics as {sample name with labels: value}."""
    samples = {}
    for line in HTTP.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_streamed_completion_runs_both_legs_and_keeps_openai_shapes(make_cluster):
    cluster = make_cluster()
    body = {
        "model": MODEL,
        "prompt": "a b c",
        "max_tokens": 5,
        "stream_options": {"include_usage": True},
        "min_tokens": 2,
    }
    payloads = stream(cluster.url, "/v1/completions", body)

    assert completion_text(payloads) == " a b c a b"
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert len({chunk["id"] for chunk in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert chunks[0]["choices"][0]["text"] == " a"  # the prefill leg's token, sent first
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    (prefill_request,) = cluster.prefill[0].stats.requests
    assert prefill_request["kind"] == "prefill"
    leg = prefill_request["body"]
    assert leg["stream"] is False and "stream_options" not in leg
    # the client's limits, which the prefill worker checks before it samples its one token
    assert leg["max_tokens"] == 5 and leg["min_tokens"] == 2
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    (decode_request,) = cluster.decode[0].stats.requests
    assert decode_request["kind"] == "decode"
    decoded = decode_request["body"]
    assert decoded["max_tokens"] == 5 and decoded["min_tokens"] == 2 and decoded["stream"] is True
    assert decoded["stream_options"] == {"include_usage": True}
    assert decoded["kv_transfer_params"]["num_prompt_tokens"] == 3
    assert cluster.prefill[0].stats.released == []


def test_whole_completion_is_the_decode_legs_answer(make_cluster):
    cluster = make_cluster()
    body = {"model": MODEL, "prompt": "x y", "max_tokens": 3}
    answer = HTTP.post(cluster.url + "/v1/completions", json=body).json()
    assert answer["choices"][0]["text"] == " x y x"
    assert answer["usage"]["completion_tokens"] == 3
    assert cluster.decode[0].kinds() == ["decode"]


def test_chat_through_the_openai_client(make_cluster):
    cluster = make_cluster()
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "x y z"}]

    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert whole.choices[0].message.content == " x y z x"

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == " x"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " x y z x"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1].usage.completion_tokens == 4
    prefill_leg = cluster.prefill[0].stats.requests[-1]["body"]
    assert "max_tokens" not in prefill_leg and prefill_leg["max_completion_tokens"] == 4


def test_eos_on_the_first_token_never_reaches_decode(make_cluster):
    cluster = make_cluster()
    body = {"model": MODEL, "prompt": "STOP a b", "max_tokens": 8}
    payloads = stream(cluster.url, "/v1/completions", body)
    assert completion_text(payloads) == ""
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop"
    answer = HTTP.post(cluster.url + "/v1/completions", json=body).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert "kv_transfer_params" not in answer
    assert cluster.decode[0].stats.requests == []


def test_single_token_request_is_answered_by_prefill_and_its_lease_released(make_cluster):
    cluster = make_cluster()
    messages = [{"role": "user", "content": "p q"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "stream": True}
    with HTTP.stream("POST", cluster.url + "/v1/chat/completions", json=body) as response:
        payloads = sse_payloads(response)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in payloads[:-1])
    assert text == " p"
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert cluster.decode[0].stats.requests == []
    prefill = cluster.prefill[0].stats
    wait_for(lambda: len(prefill.released) == 1)
    assert prefill.released == prefill.leased


def test_several_choices_skip_the_prefill_leg(make_cluster):
    cluster = make_cluster()
    body = {"model": MODEL, "prompt": "m n", "max_tokens": 2, "n": 2}
    answer = HTTP.post(cluster.url + "/v1/completions", json=body).json()
    assert [choice["text"] for choice in answer["choices"]] == [" m n", " m n"]
    assert cluster.prefill[0].stats.requests == []
    assert cluster.decode[0].kinds() == ["plain"]


def test_prompt_logprobs_and_tool_calls_skip_the_prefill_leg(make_cluster):
    """Only the worker that computes the prompt has its logprobs; tool calls are made of the
    whole output."""
    cluster = make_cluster()
    for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
        body = {"model": MODEL, "prompt": "m n", "max_tokens": 2, **extra}
        assert HTTP.post(cluster.url + "/v1/completions", json=body).status_code == 200
    messages = [{"role": "user", "content": "m"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    for extra in ({"prompt_logprobs": 0}, {"tools": tools, "tool_choice": "required"}):
        chat = {"model": MODEL, "messages": messages, **extra}
        assert HTTP.post(cluster.url + "/v1/chat/completions", json=chat).status_code == 200
    assert cluster.prefill[0].stats.requests == []
    assert cluster.decode[0].kinds() == ["plain"] * 4


def test_without_prefill_workers_requests_are_balanced_over_both_workers(make_cluster):
    cluster = make_cluster(prefill=0, decode=0, both=2)
    for _ in range(4):
        payloads = stream(cluster.url, "/v1/completions", {"prompt": "k", "max_tokens": 2})
        assert completion_text(payloads) == " k k"
    assert [fake.kinds() for fake in cluster.both] == [["plain", "plain"], ["plain", "plain"]]


def test_a_workers_client_error_is_relayed_unchanged(make_cluster):
    cluster = make_cluster()
    body = {"model": "no-such-model", "prompt": "a", "max_tokens": 3, "stream": True}
    response = HTTP.post(cluster.url + "/v1/completions", json=body)
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `no-such-model` does not exist.",
            "type": "BadRequestError",
            "param": None,
            "code": 404,
        }
    }
    assert cluster.decode[0].stats.requests == []


def test_a_stop_that_is_not_strings_is_a_400_before_any_worker(make_cluster):
    """A PD flow reads `stop` for its hold-back before a worker checks the body: the router
    refuses a wrong one itself (it was a 500, or a reset stream)."""
    cluster = make_cluster()
    for stop in (5, 1.5, True, ["a", 1], [None], {"a": "b"}):
        for streamed in (False, True):
            body = {"prompt": "a", "max_tokens": 3, "stream": streamed, "stop": stop}
            response = HTTP.post(cluster.url + "/v1/completions", json=body)
            assert response.status_code == 400, (stop, streamed, response.text)
            assert response.json()["error"]["code"] == "invalid_stop"
    workers = cluster.prefill + cluster.decode
    assert all(fake.stats.requests == [] for fake in workers)
    body = {"prompt": "a", "max_tokens": 3, "stop": ["zz", "yy"]}
    assert HTTP.post(cluster.url + "/v1/completions", json=body).status_code == 200


def test_no_odd_field_value_makes_the_router_fail(make_cluster):
    """Every field of the fuzz list with every odd value, in each valid body (one streamed):
    whatever the router reads on the way to the two legs (the prompt's prefix, stop, n,
    max_tokens), its answer is below 500. The fake workers refuse what a worker would, among
    the fields they read, with a 400."""
    cluster = make_cluster(decode_policy="prefix-aware")
    failures = []
    with httpx.Client(timeout=10) as client:
        for path, valid in fuzz_bodies.VALID:
            for name, value in itertools.product(fuzz_bodies.FIELDS, fuzz_bodies.ODD_VALUES):
                body = dict(valid, **{name: value})
                response = client.post(cluster.url + path, content=json.dumps(body))
                if response.status_code >= 500:
                    failures.append((path, name, repr(value)[:30], response.text[:200]))
    assert failures == []


def test_router_errors_use_the_openai_shape_and_api_key(make_cluster):
    cluster = make_cluster(api_key="sesame")
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
    refused = HTTP.post(cluster.url + "/v1/completions", json=body)
    assert refused.status_code == 401
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert HTTP.get(cluster.url + "/v1/models").status_code == 401
    assert HTTP.get(cluster.url + "/health").status_code == 200
    assert HTTP.get(cluster.url + "/version").json() == {"version": tandem.__version__}

    headers = {"Authorization": "Bearer sesame"}
    answer = HTTP.post(cluster.url + "/v1/completions", json=body, headers=headers)
    assert answer.json()["choices"][0]["text"] == " a a"
    models = HTTP.get(cluster.url + "/v1/models", headers=headers).json()
    assert [model["id"] for model in models["data"]] == [MODEL]
    bad_json = HTTP.post(cluster.url + "/v1/completions", content=b"{", headers=headers)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    bad_stream = HTTP.post(
        cluster.url + "/v1/chat/completions", json={**body, "stream": "yes"}, headers=headers
    )
    assert bad_stream.status_code == 400
    assert bad_stream.json()["error"]["code"] == "invalid_stream"
    wrong_method = HTTP.get(cluster.url + "/v1/chat/completions", headers=headers)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}


def test_the_router_sends_its_api_key_to_workers_that_want_it(make_cluster):
    """Workers that want the key the router has: the health check learns their model (from
    /v1/models), both legs of a PD request pass, streamed or not, a one-token request's lease
    is released. A router without the key passes the workers' 401 on to the client."""
    cluster = make_cluster(api_key="sesame", worker_api_key="sesame")
    headers = {"Authorization": "Bearer sesame"}
    wait_for(lambda: all(worker.model == MODEL for worker in cluster.pool.workers()))
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 3}
    answer = HTTP.post(cluster.url + "/v1/completions", json=body, headers=headers)
    assert answer.json()["choices"][0]["text"] == " a b a"
    with HTTP.stream(
        "POST", cluster.url + "/v1/completions", json={**body, "stream": True}, headers=headers
    ) as response:
        assert completion_text(sse_payloads(response)) == " a b a"
    assert cluster.decode[0].kinds() == ["decode", "decode"]
    one_token = HTTP.post(
        cluster.url + "/v1/completions", json={**body, "max_tokens": 1}, headers=headers
    )
    assert one_token.json()["choices"][0]["text"] == " a"
    prefill = cluster.prefill[0].stats
    wait_for(lambda: len(prefill.released) == 1)
    assert prefill.released == prefill.leased[-1:]  # the first two went to the decode worker

    keyless = make_cluster(worker_api_key="sesame")
    refused = HTTP.post(keyless.url + "/v1/completions", json=body)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_browsers_of_the_allowed_origins_are_answered(make_cluster):
    """--allowed-origins (CORS): a browser's preflight from an allowed origin is answered
    without the API key (it carries none), the request itself needs the key and its answer
    names the origin; another origin's preflight is refused, and without the flag no answer
    allows any origin."""
    cluster = make_cluster(api_key="sesame", allowed_origins=("https://ui.example",))
    path = cluster.url + "/v1/completions"
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization",
    }
    allowed = HTTP.options(path, headers={"origin": "https://ui.example", **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 2}
    origin = {"origin": "https://ui.example"}
    assert HTTP.post(path, json=body, headers=origin).status_code == 401
    answer = HTTP.post(path, json=body, headers={**origin, "Authorization": "Bearer sesame"})
    assert answer.json()["choices"][0]["text"] == " a b"
    assert answer.headers["access-control-allow-origin"] == "https://ui.example"
    other = HTTP.options(path, headers={"origin": "https://elsewhere.example", **preflight})
    assert other.status_code == 400

    closed = make_cluster()
    answer = HTTP.post(closed.url + "/v1/completions", json=body, headers=origin)
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_a_refusing_or_dead_prefill_worker_is_retried_on_another(make_cluster):
    cluster = make_cluster(prefill=2, prefill_policy="round-robin", health_interval_s=30)
    refusing, healthy = cluster.prefill
    refusing.control.refuse_status = 503
    for _ in range(2):
        payloads = stream(cluster.url, "/v1/completions", {"prompt": "r s", "max_tokens": 3})
        assert completion_text(payloads) == " r s r"
    # Round robin sends each request to the refusing worker first; the leg moves on.
    assert refusing.kinds() == ["prefill", "prefill"]
    assert healthy.kinds() == ["prefill", "prefill"]
    assert metric_samples(cluster.url)['tandem_router_refusals_total{leg="prefill"}'] == 2

    refusing.control.refuse_status = None
    healthy.server.stop()
    for _ in range(3):
        payloads = stream(cluster.url, "/v1/completions", {"prompt": "r s", "max_tokens": 3})
        assert completion_text(payloads) == " r s r"
    assert [worker.url for worker in cluster.pool.available(("prefill",))] == [refusing.url]


@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_worker_error_is_relayed_not_retried_on_another_worker(make_cluster, status: int):
    """A 5xx other than 503 may be the request's own doing (a worker's 500 is its engine failing
    on that request): tried on every worker in turn, it would fail, or kill, each of them. It
    goes to the client as it is; a 503 (the worker cannot take it now) moves the leg on."""
    cluster = make_cluster(prefill=0, decode=2, decode_policy="round-robin", health_interval_s=30)
    failing, healthy = cluster.decode
    failing.control.refuse_status = status
    body = {"prompt": "r s", "max_tokens": 3}
    for streamed in (False, True):  # round robin: the failing worker first, then the other
        response = HTTP.post(cluster.url + "/v1/completions", json=dict(body, stream=streamed))
        assert response.status_code == status, response.text
        assert response.json()["error"]["message"] == "the fake worker refuses requests now"
        assert len(failing.kinds()) == len(healthy.kinds()) + 1  # not tried on the other
        assert HTTP.post(cluster.url + "/v1/completions", json=body).status_code == 200

    failing.control.refuse_status = 503
    answer = HTTP.post(cluster.url + "/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " r s r"
    assert failing.kinds() == ["plain"] * 3 and healthy.kinds() == ["plain"] * 3


def test_tokenize_with_no_worker_answering_is_a_503_naming_them(make_cluster):
    cluster = make_cluster(health_interval_s=30)
    workers = cluster.prefill + cluster.decode
    for fake in workers:
        fake.server.stop()
    response = httpx.post(cluster.url + "/tokenize", json={"prompt": "r s"}, timeout=30)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "no_worker"
    assert all(fake.url in error["message"] for fake in workers)


def test_decode_refusal_after_the_first_token_ends_with_an_error_event(make_cluster):
    cluster = make_cluster()
    cluster.decode[0].control.refuse_status = 503
    payloads = stream(cluster.url, "/v1/completions", {"prompt": "a b", "max_tokens": 4})
    assert payloads[0]["choices"][0]["text"] == " a"
    assert "no decode worker could take the request" in payloads[1]["error"]["message"]
    assert payloads[2:] == ["[DONE]"]
    prefill = cluster.prefill[0].stats
    wait_for(lambda: len(prefill.released) == 1)

    response = HTTP.post(cluster.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4})
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker"
    wait_for(lambda: len(prefill.released) == 2)

    cluster.decode[0].control.refuse_status = 400  # a client error: relayed, not retried
    payloads = stream(cluster.url, "/v1/completions", {"prompt": "a b", "max_tokens": 4})
    assert payloads[1]["error"] == {
        "message": "the fake worker refuses requests now",
        "type": "server_error",
        "param": None,
        "code": "400",
    }
    assert payloads[2:] == ["[DONE]"]
    wait_for(lambda: len(prefill.released) == 3)
    assert prefill.released == prefill.leased


def test_a_client_that_leaves_aborts_the_legs(make_cluster):
    cluster = make_cluster()
    decode = cluster.decode[0]
    decode.control.token_delay_s = 0.05
    body = {"prompt": "a b", "max_tokens": 100, "stream": True}
    with HTTP.stream("POST", cluster.url + "/v1/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line.startswith("data:"))
        assert [json.loads(next(events)[5:])["choices"][0]["text"] for _ in range(3)] == [
            " a",
            " b",
            " a",
        ]
    wait_for(lambda: decode.stats.aborted_streams == 1)
    assert decode.stats.completed_streams == 0

    prefill = cluster.prefill[0]
    prefill.control.prefill_delay_s = 5.0
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(cluster.url + "/v1/completions", json=body, timeout=0.3)
    wait_for(lambda: prefill.stats.aborted_prefills == 1)
    assert len(decode.stats.requests) == 1


def test_prefix_aware_routing_sends_a_repeated_prefix_to_the_same_worker(make_cluster):
    cluster = make_cluster(prefill=2)
    system_prompts = [f"You are assistant number {i}. " + "Answer briefly. " * 12 for i in range(3)]
    for round_index in range(4):
        for system in system_prompts:
            prompt = f"{system} question {round_index}"
            HTTP.post(cluster.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    owners = {}
    for index, fake in enumerate(cluster.prefill):
        for request in fake.stats.requests:
            system = request["body"]["prompt"].split(" question ")[0]
            owners.setdefault(system, set()).add(index)
    assert all(len(workers) == 1 for workers in owners.values()), owners
    assert len(owners) == 3
    assert {index for workers in owners.values() for index in workers} == {0, 1}


def test_health_checks_take_a_worker_out_and_bring_it_back(make_cluster):
    cluster = make_cluster(health_interval_s=0.1, health_failures=2)
    decode = cluster.decode[0]
    decode.control.health_status = 503
    wait_for(lambda: HTTP.get(cluster.url + "/health").status_code == 503, timeout=3)
    assert HTTP.get(cluster.url + "/health").json()["workers"]["decode"] == 0
    decode.control.health_status = 200
    wait_for(lambda: HTTP.get(cluster.url + "/health").status_code == 200, timeout=3)


def test_workers_register_with_the_cluster_token_and_leave(make_cluster):
    cluster = make_cluster(decode=0, cluster_token="secret", heartbeat_timeout_s=0.6)
    decode = start_fake("decode")
    try:
        announcement = {"url": decode.url, "role": "decode", "model": MODEL}
        register = cluster.url + "/internal/workers/register"
        wrong = HTTP.post(register, json=announcement, headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_cluster_token"
        refused = HeartbeatSender(
            cluster.url, decode.url, "decode", MODEL, "wrong", interval_s=0.05
        )
        refused.start()
        time.sleep(0.2)
        refused.stop()  # a sender that was refused throughout neither raises nor registers
        assert [worker.url for worker in cluster.pool.workers()] == [cluster.prefill[0].url]

        sender = HeartbeatSender(cluster.url, decode.url, "decode", MODEL, "secret", interval_s=0.1)
        sender.start()
        wait_for(lambda: HTTP.get(cluster.url + "/health").status_code == 200)
        payloads = stream(cluster.url, "/v1/completions", {"prompt": "h i", "max_tokens": 3})
        assert completion_text(payloads) == " h i h"
        assert decode.kinds() == ["decode"]
        sender.stop()
        assert HTTP.get(cluster.url + "/health").status_code == 503

        HTTP.post(register, json=announcement, headers={"Authorization": "Bearer secret"})
        wait_for(lambda: HTTP.get(cluster.url + "/health").status_code == 200, timeout=2)
        wait_for(lambda: HTTP.get(cluster.url + "/health").status_code == 503, timeout=2)
    finally:
        decode.server.stop()


def test_registration_is_refused_without_a_cluster_token(make_cluster):
    cluster = make_cluster()
    announcement = {"url": "http://127.0.0.1:1", "role": "decode", "model": MODEL}
    response = HTTP.post(cluster.url + "/internal/workers/register", json=announcement)
    assert response.status_code == 403
    assert "--cluster-token" in response.json()["error"]["message"]


def test_metrics_count_outcomes_and_latencies(make_cluster):
    cluster = make_cluster()
    for _ in range(3):
        stream(cluster.url, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    HTTP.post(cluster.url + "/v1/completions", json={"model": "nope", "prompt": "a"})
    samples = metric_samples(cluster.url)
    assert samples['tandem_router_requests_total{endpoint="completions",outcome="success"}'] == 3
    assert (
        samples['tandem_router_requests_total{endpoint="completions",outcome="client_error"}'] == 1
    )
    assert samples['tandem_router_ttft_seconds_count{endpoint="completions"}'] == 3
    assert samples['tandem_router_e2e_seconds_count{endpoint="completions"}'] == 4
    assert samples["tandem_router_added_seconds_count"] == 4
    decode_gauge = (
        f'tandem_router_worker_outstanding{{role="decode",worker="{cluster.decode[0].url}"}}'
    )
    assert samples[decode_gauge] == 0
