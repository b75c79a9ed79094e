"""The PD fields' trust boundary: only the cluster sets kv_transfer_params and releases leases.

One cluster of real workers on a tiny checkpoint (with a small tokenizer, for chat and tool
calls) serves the module, every process with `--api-key KEY`:

    prefill, decode   --cluster-token TOKEN: PD fields and /v1/kv/release from TOKEN's bearer
                      only (403 for a client), every field checked (400 naming it)
    open              --role both --kv-transport tcp, no token: open to any client, as before
                      tokens (it warns at start); the reference for every answer
    two routers       handoff / in sequence, --cluster-token TOKEN: strip a client's PD fields,
                      send TOKEN to the workers

A TCP trap listens where a client's forged fields point a decode worker (remote_host,
remote_port): no worker may ever connect to it. Then unit tests of `tandem.kv.params`,
`tandem.access` and the router's intake of bodies.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from transformers import PreTrainedTokenizerFast

from pd_fixtures import (
    HTTP_TIMEOUT_S,
    REMOTE_DECODE_PARAMS,
    assert_nothing_held,
    post,
    prefill_leg,
    run_direct,
    run_pd,
    running_routers,
    running_workers,
    token_prompt,
    wait_for_value,
    with_defaults,
)
from tandem.access import guard
from tandem.cli import build_parser
from tandem.kv.params import (
    HandedOutLeases,
    KVParamsError,
    WorkerKV,
    check_kv_transfer_params,
    to_wire,
    typed,
)
from tandem.router.app import parse_request_body
from tandem.router.config import RouterConfig
from tiny_models import byte_level_bpe
from worker_fixtures import free_port

KEY = "key-of-the-clients"
TOKEN = "token-of-the-cluster"
CHECKPOINT = "llama-gqa"  # 2 layers, 2 KV heads of 16, vocabulary of 512
VOCAB_SIZE = 512
BLOCK_SIZE = 16
KV_LAYOUT = "2x2x2x16:float32"
TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
COMPLETIONS, CHAT, RELEASE = "/v1/completions", "/v1/chat/completions", "/v1/kv/release"
MESSAGES = [{"role": "user", "content": "what is the weather in Paris"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
# finding 2's request: tool calls go whole to one worker (the router's plain path)
TOOL_CALL = {"messages": MESSAGES, "max_tokens": 12, "tools": TOOLS, "tool_choice": "required"}


def checkpoint_with_tokenizer(source: Path, directory: Path) -> Path:
    """`source` with a small byte-level BPE tokenizer beside it."""
    shutil.copytree(source, directory)
    core = byte_level_bpe([MESSAGES[0]["content"]] * 10, 300)
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>").save_pretrained(directory)
    return directory


class Trap:
    """A TCP listener that no worker may connect to."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def assert_untouched(self, wait: float = 0.5) -> None:
        readable, _, _ = select.select([self.sock], [], [], wait)
        assert not readable, "a worker connected where a client's kv_transfer_params pointed"


@pytest.fixture(scope="module")
def trap() -> Iterator[Trap]:
    listener = Trap()
    yield listener
    listener.sock.close()


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("pd-trust")
    model = checkpoint_with_tokenizer(tiny_checkpoints[CHECKPOINT], log_dir / "model")
    common = ("--api-key", KEY, "--chat-template", TEMPLATE, "--num-kv-blocks", "256")
    token = ("--cluster-token", TOKEN)
    specs = {
        "prefill": ("--role", "prefill", *token, *common),
        "decode": ("--role", "decode", *token, *common),
        "open": ("--role", "both", "--kv-transport", "tcp", *common),
    }
    with running_workers(log_dir, specs, str(model)) as workers:
        prefill, decode = workers["prefill"].url, workers["decode"].url
        with running_routers(log_dir, prefill, decode, *token, "--api-key", KEY) as routers:
            yield {**workers, **{f"router {name}": r for name, r in routers.items()}}


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """A client of the cluster: it holds the API key."""
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(headers=headers, timeout=HTTP_TIMEOUT_S) as http:
        yield http


@pytest.fixture(scope="module")
def member() -> Iterator[httpx.Client]:
    """What tandem's router is to its workers: the holder of the cluster token (no API key)."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(headers=headers, timeout=HTTP_TIMEOUT_S) as http:
        yield http


def decode_leg_params(num_prompt_tokens: int, port: int, **changes) -> dict:
    """A well-formed decode leg's params, for a prompt whose KV is at 127.0.0.1:port: forged by
    a client, they would have a decode worker load whatever is there into its prefix cache,
    where later requests with that prompt would find it."""
    num_blocks = -(-num_prompt_tokens // BLOCK_SIZE)
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "forged",
        "remote_request_id": "forged-1",
        "remote_block_ids": list(range(num_blocks)),
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
        "kv_transport": "tcp",
        "first_token_id": 7,
        "num_prompt_tokens": num_prompt_tokens,
        "block_size": BLOCK_SIZE,
        "kv_layout": KV_LAYOUT,
    }
    return dict(params, **changes)


def test_workers_refuse_a_client_s_pd_fields_and_allocate_nothing(client, cluster, trap):
    prefill, decode = cluster["prefill"], cluster["decode"]
    prompt = token_prompt(1, 40, 1, VOCAB_SIZE)
    forged = decode_leg_params(len(prompt), trap.port)
    completion = {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": forged}
    cases = [
        (decode, COMPLETIONS, completion),
        (decode, COMPLETIONS, dict(completion, stream=True)),
        (decode, CHAT, dict(TOOL_CALL, kv_transfer_params=dict(forged, first_token_id=10**9))),
        (decode, COMPLETIONS, dict(completion, kv_transfer_params={})),
        (prefill, COMPLETIONS, dict(completion, kv_transfer_params=REMOTE_DECODE_PARAMS)),
    ]
    for worker, path, body in cases:
        answer = client.post(worker.url + path, json=body)
        assert answer.status_code == 403, answer.text
        error = answer.json()["error"]
        assert error["code"] == "pd_fields_forbidden" and error["param"] == "kv_transfer_params"
        assert "send the request without them" in error["message"]
    anonymous = httpx.post(decode.url + COMPLETIONS, json=completion)
    assert anonymous.status_code == 401  # the API key is checked first
    trap.assert_untouched()
    assert_nothing_held(prefill, decode)
    # the same requests without the fields are served
    plain = client.post(decode.url + COMPLETIONS, json=dict(completion, kv_transfer_params=None))
    assert plain.status_code == 200, plain.text
    assert post(client, decode.url + CHAT, with_defaults(TOOL_CALL)).completion_tokens


def test_the_cluster_s_requests_may_set_them(client, member, cluster):
    """The cluster token passes the workers' API key check, and its holder runs both legs."""
    body = {"prompt": token_prompt(2, 70, 1, VOCAB_SIZE), "max_tokens": 6, "temperature": 0.0}
    pd = run_pd(member, cluster["prefill"].url, cluster["decode"].url, COMPLETIONS, body)
    assert pd == run_direct(client, cluster["open"].url, COMPLETIONS, body)
    assert_nothing_held(cluster["prefill"], cluster["decode"])


def test_bad_field_values_from_the_cluster_are_400s_before_the_engine(client, member, cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    body = with_defaults(
        {"prompt": token_prompt(3, 200, 1, VOCAB_SIZE), "max_tokens": 4, "temperature": 0.0}
    )
    params = prefill_leg(member, prefill.url, COMPLETIONS, body)["kv_transfer_params"]
    ids = params["remote_block_ids"]
    assert len(ids) == 13
    bad_values = {
        "first_token_id": [10**9, 1e9, -1, "a", VOCAB_SIZE, True],
        "remote_port": [0, 70000, "80"],
        "remote_block_ids": [ids[:-1], [*ids, 0], [-1, *ids[1:]], "1,2"],
        "num_prompt_tokens": [201, 0],
        "block_size": [32],
        "remote_host": ["", "h" * 1000],
        "kv_transport": ["cuda-ipc"],
        "tp_size": [0, 65],
        "kv_layout": ["30x2x3x64:float16", "x"],
        "remote_request_id": [""],
    }
    for field, values in bad_values.items():
        for value in values:
            tampered = dict(body, kv_transfer_params=dict(params, **{field: value}))
            answer = member.post(decode.url + COMPLETIONS, json=tampered)
            assert answer.status_code == 400, (field, value, answer.text)
            error = answer.json()["error"]
            assert error["param"] == f"kv_transfer_params.{field}", (field, value, error)
            assert error["message"].startswith(f"kv_transfer_params.{field}"), error
    top_outside = {"logprob": -0.1, "top": [[VOCAB_SIZE, -0.1]]}
    for value in (top_outside, {"logprob": "a"}, {"top": []}, 5):
        tampered = dict(body, kv_transfer_params=dict(params, first_token_logprobs=value))
        answer = member.post(decode.url + COMPLETIONS, json=tampered)
        assert answer.status_code == 400, (value, answer.text)
        assert answer.json()["error"]["param"].startswith("kv_transfer_params.first_token_logprobs")
    # finding 2's request from the cluster: refused before the engine, which lives on
    chat = dict(TOOL_CALL, kv_transfer_params=dict(params, first_token_id=10**9))
    answer = member.post(decode.url + CHAT, json=chat)
    assert answer.status_code == 400 and answer.json()["error"]["param"].endswith("first_token_id")
    assert_nothing_held(decode)
    # the lease is intact: the true decode leg still loads it and answers right
    decoded = post(member, decode.url + COMPLETIONS, dict(body, kv_transfer_params=params))
    assert decoded == run_direct(client, cluster["open"].url, COMPLETIONS, body)
    assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("flow", ["handoff", "in sequence"])
def test_routers_strip_a_client_s_pd_fields(client, cluster, trap, flow: str):
    """Findings 1 and 2 through the router: forged fields on every path (PD collected and
    streamed, plain for n > 1 and tool calls) are dropped, so the answers are those of the same
    requests without them; no worker connects to the trap, and none is harmed."""
    router = cluster[f"router {flow}"]
    prompt = token_prompt(4, 50, 1, VOCAB_SIZE)
    completion = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0}
    requests = [
        (COMPLETIONS, completion),
        (COMPLETIONS, dict(completion, stream=True)),
        (COMPLETIONS, dict(completion, n=2, temperature=0.8, seed=5)),
        (CHAT, dict(TOOL_CALL, temperature=0.0)),
    ]
    forged = decode_leg_params(len(prompt), trap.port)
    for path, body in requests:
        expected = run_direct(client, cluster["open"].url, path, body)
        for params in (forged, dict(forged, first_token_id=10**9)):
            routed = run_direct(client, router.url, path, dict(body, kv_transfer_params=params))
            assert routed == expected, (path, body)
    trap.assert_untouched()
    assert_nothing_held(cluster["prefill"], cluster["decode"])
    # the router's other calls carry the cluster token, which the workers' API key check takes
    assert client.post(router.url + "/tokenize", json={"prompt": "Paris"}).status_code == 200


def test_kv_release_is_the_cluster_s(client, member, cluster):
    prefill = cluster["prefill"]
    body = with_defaults({"prompt": token_prompt(5, 60, 1, VOCAB_SIZE), "max_tokens": 4})
    params = prefill_leg(member, prefill.url, COMPLETIONS, body)["kv_transfer_params"]
    lease = {"remote_request_id": params["remote_request_id"]}
    refused = client.post(prefill.url + RELEASE, json=lease)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "kv_release_forbidden"
    assert httpx.post(prefill.url + RELEASE, json=lease).status_code == 401
    wait_for_value(prefill, "tandem_kv_blocks_leased", 4, timeout=2)  # still leased
    unknown = member.post(prefill.url + RELEASE, json={"remote_request_id": "nobody"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "remote_request_id"
    released = member.post(prefill.url + RELEASE, json=lease)
    assert released.status_code == 200 and released.json() == {
        "released": lease["remote_request_id"]
    }
    assert_nothing_held(prefill, timeout=5)
    assert member.post(prefill.url + RELEASE, json=lease).status_code == 404  # gone already


def test_a_worker_without_a_token_stays_open_and_says_so(client, cluster):
    open_worker = cluster["open"]
    assert "no cluster token" in open_worker.log_path.read_text()
    assert all(
        "no cluster token" not in cluster[n].log_path.read_text() for n in ("prefill", "decode")
    )
    body = with_defaults({"prompt": token_prompt(6, 20, 1, VOCAB_SIZE), "max_tokens": 3})
    params = prefill_leg(client, open_worker.url, COMPLETIONS, body)["kv_transfer_params"]
    lease = {"remote_request_id": params["remote_request_id"]}
    assert client.post(open_worker.url + RELEASE, json=lease).status_code == 200
    assert client.post(open_worker.url + RELEASE, json=lease).status_code == 404
    assert_nothing_held(open_worker)


# ---- tandem.kv.params ---------------------------------------------------------------------------

TCP_DECODER = WorkerKV("decode", "tcp", BLOCK_SIZE, VOCAB_SIZE)
DECODE_LEG = decode_leg_params(40, 5000)
HANDOFF_LEG = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "handoff_id": "h1",
    "remote_host": "10.0.0.2",
    "remote_port": 7000,
    "kv_transport": "tcp",
}


def parse(raw, worker: WorkerKV, num_prompt_tokens: int):
    """What the worker's API process does with a body's params: type them, hold them to it."""
    if raw is None:
        return None
    params = typed(raw)
    check_kv_transfer_params(params, worker, num_prompt_tokens)
    return params


@pytest.mark.parametrize(
    ("worker", "raw", "expected"),
    [
        (TCP_DECODER, dict(DECODE_LEG, kv_ipc_handle=None, vllm_field=1), DECODE_LEG),
        (TCP_DECODER, HANDOFF_LEG, HANDOFF_LEG),
        (TCP_DECODER, dict(HANDOFF_LEG, first_token_id=None), HANDOFF_LEG),
        (TCP_DECODER, {}, {}),
        (
            WorkerKV("prefill", "tcp", 16, 512),
            REMOTE_DECODE_PARAMS,
            {"do_remote_decode": True, "do_remote_prefill": False},
        ),
        (
            WorkerKV("both", "cuda-ipc", 16, 512),
            {"do_remote_decode": True, "handoff_id": "h"},
            {"do_remote_decode": True, "handoff_id": "h"},
        ),
        (WorkerKV(None, None, 16, 512), None, None),
    ],
    ids=[
        "decode leg",
        "handoff leg",
        "handoff with a null token",
        "empty",
        "prefill leg",
        "prefill handoff",
        "none",
    ],
)
def test_params_a_worker_takes(worker, raw, expected):
    """Known fields pass on as given (nulls and unknown keys left out)."""
    params = parse(raw, worker, 40)
    assert (None if params is None else to_wire(params)) == expected


@pytest.mark.parametrize(
    ("worker", "raw", "field"),
    [
        (TCP_DECODER, dict(DECODE_LEG, first_token_id=VOCAB_SIZE), "first_token_id"),
        (TCP_DECODER, dict(DECODE_LEG, first_token_id=2.0), "first_token_id"),
        (
            TCP_DECODER,
            {k: v for k, v in DECODE_LEG.items() if k != "first_token_id"},
            "first_token_id",
        ),
        (TCP_DECODER, dict(DECODE_LEG, remote_block_ids=None), "remote_block_ids"),
        (TCP_DECODER, dict(DECODE_LEG, remote_block_ids=[0, 1, "2"]), "remote_block_ids"),
        (TCP_DECODER, dict(DECODE_LEG, remote_engine_id=None), "remote_engine_id"),
        (TCP_DECODER, dict(DECODE_LEG, do_remote_decode=True), "do_remote_prefill"),
        (TCP_DECODER, dict(DECODE_LEG, do_remote_prefill="yes"), "do_remote_prefill"),
        (TCP_DECODER, dict(DECODE_LEG, handoff_id=7), "handoff_id"),
        (TCP_DECODER, dict(DECODE_LEG, kv_layout=""), "kv_layout"),
        (TCP_DECODER, {k: v for k, v in HANDOFF_LEG.items() if k != "remote_port"}, "remote_port"),
        (TCP_DECODER, dict(HANDOFF_LEG, kv_transport=None), "kv_transport"),
        (TCP_DECODER, REMOTE_DECODE_PARAMS, "do_remote_decode"),  # a decode worker serves none
        (WorkerKV("prefill", "tcp", 16, 512), DECODE_LEG, "do_remote_prefill"),
        (WorkerKV(None, None, 16, 512), REMOTE_DECODE_PARAMS, "do_remote_decode"),
        (
            WorkerKV("decode", "cuda-ipc", 16, 512),
            dict(DECODE_LEG, kv_transport="cuda-ipc"),
            "kv_ipc_handle",
        ),
    ],
)
def test_params_a_worker_refuses_name_the_field(worker, raw, field):
    with pytest.raises(KVParamsError) as refusal:
        parse(raw, worker, 40)
    assert refusal.value.param == f"kv_transfer_params.{field}"
    assert str(refusal.value).startswith(f"kv_transfer_params.{field}")


def test_handed_out_leases_are_known_until_their_timeout(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("tandem.kv.params.time.monotonic", lambda: clock[0])
    leases = HandedOutLeases(lease_timeout_s=30.0)
    leases.add("a")
    clock[0] = 110.0
    leases.add("b")
    assert leases.pop("a") and not leases.pop("a")  # released: forgotten
    clock[0] = 120.0
    leases.add("a")
    clock[0] = 140.5  # past b's timeout, not a's second one
    assert not leases.pop("b") and leases.pop("a") and not leases.pop("never")


# ---- tandem.access, the command lines, the router's intake --------------------------------------


def test_the_api_key_check_lets_the_cluster_token_through():
    app = Starlette(routes=[Route("/v1/models", lambda request: PlainTextResponse("ok"))])
    guard(app, "key", cluster_token="token")
    http = TestClient(app)
    for bearer, status in [("key", 200), ("token", 200), ("other", 401), ("tokén", 401), ("", 401)]:
        header = f"Bearer {bearer}".encode()  # a non-ASCII one too: a 401, not a 500
        answer = http.get("/v1/models", headers={"authorization": header})
        assert answer.status_code == status, bearer
    key_only = Starlette(routes=[Route("/v1/models", lambda request: PlainTextResponse("ok"))])
    guard(key_only, "key")
    answer = TestClient(key_only).get("/v1/models", headers={"authorization": "Bearer token"})
    assert answer.status_code == 401


def test_the_cluster_token_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_CLUSTER_TOKEN", "from-env")
    parser = build_parser()
    assert parser.parse_args(["worker", "--model", "m"]).cluster_token == "from-env"
    assert parser.parse_args(["router"]).cluster_token == "from-env"
    monkeypatch.delenv("TANDEM_CLUSTER_TOKEN")
    assert build_parser().parse_args(["worker", "--model", "m"]).cluster_token is None


def test_the_router_takes_pd_fields_out_of_client_bodies_and_sends_the_token():
    body = parse_request_body(b'{"prompt": "hi", "kv_transfer_params": {"remote_port": 1}}')
    assert body == {"prompt": "hi"}
    assert RouterConfig(api_key="key", cluster_token="token").worker_bearer == "token"
    assert RouterConfig(api_key="key").worker_bearer == "key"
    assert RouterConfig().worker_bearer is None


@pytest.fixture(scope="module")
def vllm_router(cluster, tmp_path_factory) -> Iterator[str]:
    """vllm-router over the prefill and decode workers. On the PD legs it sends the bearer it finds
    in its environment's OPENAI_API_KEY (not its --api-key): the cluster token goes there."""
    binary = shutil.which("vllm-router") or shutil.which(
        "vllm-router", path=str(Path(sys.executable).parent)
    )
    if binary is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    port = free_port()
    command = [binary, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prefill", cluster["prefill"].url, "--decode", cluster["decode"].url]
    command += ["--policy", "round_robin", "--disable-retries", "--disable-circuit-breaker"]
    log_path = tmp_path_factory.mktemp("vllm-router") / "router.log"
    with open(log_path, "wb") as log:
        env = dict(os.environ, OPENAI_API_KEY=TOKEN)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_vllm_router_drives_workers_with_a_token(client, cluster, vllm_router):
    body = {"prompt": token_prompt(7, 45, 1, VOCAB_SIZE), "max_tokens": 5, "temperature": 0.0}
    for stream in (False, True):
        routed = run_direct(client, vllm_router, COMPLETIONS, dict(body, stream=stream))
        assert routed == run_direct(client, cluster["open"].url, COMPLETIONS, body), stream
    assert_nothing_held(cluster["prefill"], cluster["decode"])
