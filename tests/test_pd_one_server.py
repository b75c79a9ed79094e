"""Role pd: a prefill engine and a decode engine behind one server (`tandem worker --role pd`),
on the default model (CPU, KV over TCP between the two engines), give exactly the answers of a
`both` worker, hand every eligible request over through the KV transport, and leave no block
held behind on any path (first token ending the request, stop strings, client disconnects).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from pd_fixtures import (
    assert_nothing_held,
    metric,
    post,
    prompt_set,
    running_workers,
    wait_until,
    with_defaults,
)
from tandem.engine.config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.server.engine_client import QueueFullError
from tandem.server.pd_client import DisaggregatedClient, place_engines
from worker_fixtures import DEFAULT_MODEL

PROMPTS = prompt_set(1000, 300, 20000)[::2]
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 1234}}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, there was a little"  # greedy: " girl named Emma who loved to"
COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
HANDOFFS = "tandem_kv_transfer_seconds_count"  # one per load the decode engine made


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict]:
    specs = {
        "pd": ("--role", "pd", "--num-kv-blocks", "256"),
        "both": ("--role", "both", "--num-kv-blocks", "256"),
    }
    with running_workers(tmp_path_factory.mktemp("pd-one"), specs, DEFAULT_MODEL) as workers:
        yield workers


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as http:
        yield http


def both_ways(client, servers, path: str, body: dict):
    """The same request on the pd server and on the `both` worker."""
    body = with_defaults(body)
    return post(client, servers["pd"].url + path, body), post(
        client, servers["both"].url + path, body
    )


def test_health_names_the_role_and_no_kv_endpoint(client, servers):
    health = client.get(servers["pd"].url + "/health").json()
    load = health.pop("load")
    assert health == {"status": "ok", "role": "pd", "kv": None}
    assert load["requests_running"] == load["requests_waiting"] == 0


def test_prompts_are_handed_over_and_match_the_both_worker(client, servers):
    """Four prompts of 17 to 960 tokens, one per sampling and streaming variant."""
    prompts = PROMPTS[1::2]
    before = metric(servers["pd"], HANDOFFS)
    variants = [(sampling, stream) for stream in (False, True) for sampling in SAMPLING]
    for index, prompt in enumerate(prompts):
        sampling, stream = variants[index % len(variants)]
        body = {"prompt": prompt, "max_tokens": 6, "stream": stream, **SAMPLING[sampling]}
        pd, both = both_ways(client, servers, COMPLETIONS, body)
        assert pd == both, f"prompt of {len(prompt)} tokens, {sampling}, stream={stream}"
        assert len(pd.token_ids) == pd.completion_tokens == 6
    assert metric(servers["pd"], HANDOFFS) - before == len(prompts)
    assert metric(servers["pd"], "tandem_kv_transfer_failures_total") == 0
    assert_nothing_held(servers["pd"])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_and_text_prompts_match_the_both_worker(client, servers, stream: bool):
    body = {"messages": CHAT, "max_tokens": 10, "temperature": 0, "stream": stream}
    pd, both = both_ways(client, servers, CHAT_COMPLETIONS, body)
    assert pd == both and pd.text == "The capital of France is Paris."
    body = {"prompt": STORY, "max_tokens": 6, "temperature": 0, "stream": stream}
    pd, both = both_ways(client, servers, COMPLETIONS, body)
    assert pd == both and pd.text == " girl named Emma who loved to"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("stop", "include"),
    [
        ([" girl"], False),  # the first token completes it: the request ends at the prefill engine
        ([" girl"], True),
        ([" girl named"], False),  # completed by the second token: the first token's text is held
        ([" girl named"], True),
        ([" girl named Bob"], False),  # held back, then let out when it cannot match any more
        ([" who"], False),
    ],
    ids=["girl-cut", "girl-included", "named-cut", "named-included", "bob-cut", "who-cut"],
)
def test_stop_strings_match_the_both_worker(client, servers, stop: list[str], stream, include):
    """Also with include_stop_str_in_output (the stop string stays in the text, nothing is
    held back) where the string completes, by the first token or by the second."""
    body = {"prompt": STORY, "max_tokens": 6, "temperature": 0, "stop": stop, "stream": stream}
    body["include_stop_str_in_output"] = include
    pd, both = both_ways(client, servers, COMPLETIONS, body)
    assert pd == both
    completed = stop[0] in " girl named Emma who loved to"  # the output without stop strings
    assert pd.text.endswith(stop[0]) == (include and completed)
    assert_nothing_held(servers["pd"])


def test_a_stop_token_first_ends_the_request(client, servers):
    first = both_ways(client, servers, COMPLETIONS, {"prompt": STORY, "max_tokens": 1})[1]
    body = {"prompt": STORY, "max_tokens": 6, "temperature": 0, "stream": True}
    pd, both = both_ways(client, servers, COMPLETIONS, dict(body, stop_token_ids=first.token_ids))
    assert pd == both and pd.finish_reason == "stop" and pd.token_ids == first.token_ids
    assert_nothing_held(servers["pd"])


@pytest.mark.parametrize(
    "extra",
    [{"max_tokens": 1}, {"n": 2, "max_tokens": 4}, {"prompt_logprobs": 2, "max_tokens": 3}],
    ids=["one-token", "n=2", "prompt-logprobs"],
)
def test_requests_for_one_engine_match_the_both_worker(client, servers, extra: dict):
    body = {"prompt": STORY, "temperature": 0, **extra}
    answers = [
        client.post(servers[name].url + COMPLETIONS, json=body).json() for name in ("pd", "both")
    ]
    for answer in answers:
        del answer["id"], answer["created"]
    assert answers[0] == answers[1]


def test_structured_output_matches_the_both_worker(client, servers):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    body = {"messages": CHAT, "max_tokens": 32, "temperature": 0, "stream": True}
    pd, both = both_ways(
        client, servers, CHAT_COMPLETIONS, dict(body, response_format=response_format)
    )
    assert pd == both and pd.finish_reason == "stop"


def test_kv_transfer_params_from_a_client_are_refused(client, servers):
    body = {"prompt": STORY, "max_tokens": 4, "kv_transfer_params": {"do_remote_decode": True}}
    answer = client.post(servers["pd"].url + COMPLETIONS, json=body)
    assert answer.status_code == 400 and "kv_transfer_params" in answer.text


def test_a_client_leaving_mid_stream_leaves_nothing_held(client, servers):
    pd = servers["pd"]
    body = {"prompt": PROMPTS[-1], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with client.stream("POST", pd.url + COMPLETIONS, json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: metric(pd, "tandem_kv_cache_blocks_used") > 0, 10, "nothing running")
    assert_nothing_held(pd)
    assert post(client, pd.url + COMPLETIONS, with_defaults(dict(body, max_tokens=2))).token_ids


@pytest.mark.parametrize(
    ("device", "decode_device", "expected"),
    [
        ("cpu", "auto", ("cpu", "cpu", 0.9)),
        ("cuda:0", "cuda:1", ("cuda:0", "cuda:1", 0.9)),
        ("cuda", "cuda:0", ("cuda:0", "cuda:0", 0.45)),  # one GPU: half the memory each
    ],
)
def test_engine_placement(device: str, decode_device: str, expected: tuple):
    prefill, decode = place_engines(EngineConfig(device=device), decode_device)
    assert prefill.gpu_memory_utilization == decode.gpu_memory_utilization
    assert (prefill.device, decode.device, prefill.gpu_memory_utilization) == expected


class StubStream:
    """A submitted leg that never has a delta; closing it is recorded."""

    def __init__(self, engine: StubEngine, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id

    async def next(self):
        await asyncio.Event().wait()

    async def close(self) -> None:
        self.engine.closed.append(self.request_id)


class StubEngine:
    """An engine client whose legs wait forever (or are refused at once), recording aborts."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.kv_config = SimpleNamespace(host="127.0.0.1", transport="tcp")
        self.info = SimpleNamespace(kv_port=1)
        self.stats_listener = None
        self.aborted: list[str] = []
        self.closed: list[str] = []

    async def submit(self, request_id, prompt_token_ids, params, kv_transfer_params=None):
        if self.refuse:
            raise QueueFullError("the queue is full")
        return StubStream(self, request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_decode_leg_refused_aborts_the_prefill_leg():
    """The prefill leg goes in first; when the decode engine refuses its leg, the prefill leg is
    aborted (which also ends its lease if it is done already) and the refusal is the answer."""
    prefill, decode = StubEngine(), StubEngine(refuse=True)
    client = DisaggregatedClient(prefill, decode)

    async def run() -> None:
        async for _ in client.generate("r", [1, 2, 3], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(QueueFullError):
        asyncio.run(run())
    assert prefill.aborted == ["r"] and prefill.closed == ["r"]
