"""PD on the default model (smollm2-135m-instruct): a prefill and a decode worker, driven leg by
leg by the test client and by vllm-router, give exactly the answers of a `both` worker.

One trio of real workers (prefill, decode, both) serves the whole module. Answers are compared
on token ids (`return_token_ids`), text, finish reason and usage.completion_tokens, for greedy
and seeded sampling, collected and streamed, on /v1/completions (token-id and text prompts) and
/v1/chat/completions (max_tokens and max_completion_tokens).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pd_fixtures import (
    Completion,
    assert_nothing_held,
    metric,
    post,
    prefill_leg,
    prompt_set,
    read_stream,
    run_direct,
    run_pd,
    run_pd_and_direct,
    running_routers,
    running_workers,
    token_prompt,
    wait_for_value,
    wait_until,
    with_defaults,
)
from worker_fixtures import DEFAULT_MODEL, free_port

MAX_TOKENS = 8
BLOCK_SIZE = 16
# smollm2-135m: 30 layers x (K, V) x 3 KV heads x head_dim 64 x float32, per token
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
COMMON_FLAGS = ("--num-kv-blocks", "512")

PROMPTS = prompt_set(2000, 300, 20000)
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "seed": 1234},
}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def trio(tmp_path_factory) -> Iterator[dict]:
    specs = {
        "prefill": ("--role", "prefill", *COMMON_FLAGS),
        "decode": ("--role", "decode", *COMMON_FLAGS),
        "both": ("--role", "both", *COMMON_FLAGS),
    }
    with running_workers(tmp_path_factory.mktemp("pd-default"), specs, DEFAULT_MODEL) as workers:
        yield workers


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as http:
        yield http


VARIANTS = [(sampling, stream) for stream in (False, True) for sampling in SAMPLING]


@pytest.mark.slow  # 30 s of long token-id prompts; the text and chat tests here are fast
def test_token_id_prompts_match_both_worker(client, trio):
    """The 16 prompts, each with one of the 4 variants (greedy / seeded x collected / streamed),
    so every variant meets short, long, block-aligned and prefix-sharing prompts."""
    for index, prompt in enumerate(PROMPTS):
        sampling, stream = VARIANTS[index % len(VARIANTS)]
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream, **SAMPLING[sampling]}
        pd, both = run_pd_and_direct(client, trio, "/v1/completions", body)
        assert pd == both, f"prompt of {len(prompt)} tokens, {sampling}, stream={stream}"
        assert len(both.token_ids) == both.completion_tokens == MAX_TOKENS
    assert_nothing_held(trio["prefill"], trio["decode"])


@pytest.mark.parametrize(
    ("sampling", "limit", "stream"),
    [("greedy", "max_completion_tokens", True), ("seeded", "max_tokens", False)],
)
def test_chat_matches_both_worker(client, trio, sampling: str, limit: str, stream: bool):
    body = {"messages": CHAT, limit: 10, "stream": stream, **SAMPLING[sampling]}
    pd, both = run_pd_and_direct(client, trio, "/v1/chat/completions", body)
    assert pd == both
    assert len(pd.token_ids) == pd.completion_tokens
    if sampling == "greedy":
        assert pd.text == "The capital of France is Paris." and pd.finish_reason == "stop"


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_match_both_worker(client, trio, stream: bool):
    """The decode worker's grammar starts from the first token the prefill worker sampled
    under the same grammar, so PD answers as `both` does, within the constraint."""
    format_ = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
    chat = {"messages": CHAT, "max_tokens": 32, "temperature": 0, "response_format": format_}
    pd, both = run_pd_and_direct(client, trio, "/v1/chat/completions", dict(chat, stream=stream))
    assert pd == both and set(json.loads(pd.text)) == {"city"} and pd.finish_reason == "stop"
    regex = r"[0-9]{2}-[a-z]{3,6}\."
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 16,
        "temperature": 0.9,
        "seed": 5,
        "stream": stream,
        "structured_outputs": {"regex": regex},
    }
    pd, both = run_pd_and_direct(client, trio, "/v1/completions", body)
    assert pd == both and re.fullmatch(regex, pd.text) and pd.finish_reason == "stop"
    assert_nothing_held(trio["prefill"], trio["decode"])


def every_choice(client: httpx.Client, url: str, path: str, body: dict) -> list[tuple]:
    """Every choice of an answer, collected or streamed: (index, token ids, text, finish)."""
    body = with_defaults(body)
    if not body.get("stream"):
        answer = client.post(url + path, json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        chunks = [answer.json()]
    else:
        with client.stream("POST", url + path, json=body, timeout=300) as response:
            assert response.status_code == 200, response.read()
            chunks = read_stream(response)
    merged: dict[int, tuple[list[int], str, str | None]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            token_ids, text, finish = merged.get(choice["index"], ([], "", None))
            holder = choice.get("message") or choice.get("delta") or choice
            text += holder.get("content" if holder is not choice else "text") or ""
            token_ids = token_ids + choice.get("token_ids", [])
            merged[choice["index"]] = (token_ids, text, choice.get("finish_reason") or finish)
    return sorted((index, *choice) for index, choice in merged.items())


@pytest.mark.parametrize("sampling", SAMPLING)
def test_several_choices_match_both_worker(client, trio, sampling: str):
    """n > 1 with both legs carrying it, as vllm-router sends it: the prefill leg computes the
    prompt once (one choice, one lease), the decode leg samples the n choices from the prompt
    it computes itself and lets the lease go; the answer is the `both` worker's."""
    cases = [
        ("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True}),
    ]
    for path, body in cases:
        body = dict(body, n=2, **SAMPLING[sampling])
        answer = prefill_leg(client, trio["prefill"].url, path, with_defaults(body))
        assert len(answer["choices"]) == 1 and answer["kv_transfer_params"]["remote_request_id"]
        decode_body = dict(body, kv_transfer_params=answer["kv_transfer_params"])
        pd = every_choice(client, trio["decode"].url, path, decode_body)
        assert pd == every_choice(client, trio["both"].url, path, body)
        assert [choice[0] for choice in pd] == [0, 1]
        assert all(len(choice[1]) == 4 for choice in pd)
    assert_nothing_held(trio["prefill"], trio["decode"])


def test_a_decode_leg_refuses_prompt_logprobs(client, trio):
    """A decode leg loads the prompt's KV: it has no prompt logprobs to give."""
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1"}
    for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
        body = {"prompt": "Once", "max_tokens": 2, "kv_transfer_params": kv, **extra}
        answer = client.post(trio["decode"].url + "/v1/completions", json=body)
        assert answer.status_code == 400 and "prompt logprobs" in answer.text


def test_text_prompt_matches_both_worker(client, trio):
    body = {"prompt": "Once upon a time, there was a little", "max_tokens": 6, "temperature": 0}
    pd, both = run_pd_and_direct(client, trio, "/v1/completions", body)
    assert pd == both
    assert pd.text == " girl named Emma who loved to"


def test_prefill_answer_carries_the_protocol_fields(client, trio):
    prompt = PROMPTS[7]  # 257 tokens: 17 blocks, the last one holding 1 token
    body = with_defaults({"prompt": prompt, "max_tokens": 4, "temperature": 0.0})
    answer = prefill_leg(client, trio["prefill"].url, "/v1/completions", body)
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_port"], int)
    assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]
    assert isinstance(params["remote_request_id"], str) and params["remote_request_id"]
    assert len(params["remote_block_ids"]) == 17 == len(set(params["remote_block_ids"]))
    assert params["tp_size"] == 1 and params["kv_transport"] == "tcp"
    assert params["num_prompt_tokens"] == 257 and params["block_size"] == BLOCK_SIZE
    assert params["kv_layout"] == "30x2x3x64:float32"
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == [params["first_token_id"]]
    assert answer["usage"]["completion_tokens"] == 1
    # the prompt's blocks stay held, under a lease, until the decode leg reads them
    wait_for_value(trio["prefill"], "tandem_kv_blocks_leased", 17, timeout=5)
    wait_for_value(trio["prefill"], "tandem_kv_cache_blocks_used", 17, timeout=5)
    decoded = post(
        client, trio["decode"].url + "/v1/completions", dict(body, kv_transfer_params=params)
    )
    assert decoded == run_direct(client, trio["both"].url, "/v1/completions", body)
    assert decoded.token_ids[0] == params["first_token_id"] and decoded.completion_tokens == 4
    assert_nothing_held(trio["prefill"], trio["decode"])


def test_transfer_metrics_on_both_sides(client, trio):
    prefill, decode = trio["prefill"], trio["decode"]
    names = [
        (prefill, "tandem_kv_transfer_bytes_sent"),
        (prefill, "tandem_kv_transfer_blocks_sent"),
        (decode, "tandem_kv_transfer_bytes_received"),
        (decode, "tandem_kv_transfer_blocks_received"),
        (decode, "tandem_kv_transfer_seconds_count"),
    ]
    before = [metric(worker, name) for worker, name in names]
    # 117 tokens new to every worker (whichever tests ran before): 8 blocks
    prompt = token_prompt(5, 117, 300, 20000)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    run_pd(client, prefill.url, decode.url, "/v1/completions", body)
    num_blocks = 8
    num_bytes = num_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    expected = [num_bytes, num_blocks, num_bytes, num_blocks, 1]

    def deltas() -> list[float]:
        return [metric(w, n) - b for (w, n), b in zip(names, before, strict=True)]

    wait_until(lambda: deltas() == expected, 10, lambda: f"{deltas()} != {expected}")
    assert metric(decode, "tandem_kv_transfer_failures_total") == 0
    assert_nothing_held(prefill, decode)


def test_stop_string_on_the_first_token_ends_at_prefill(client, trio):
    """A stop string the first token completes finishes the request on the prefill worker: a
    finished answer, no kv_transfer_params, and no lease left behind."""
    body = {"prompt": "Once upon a time, there was a little", "max_tokens": 8}
    body = with_defaults(dict(body, temperature=0.0, stop=[" girl"]))
    answer = prefill_leg(client, trio["prefill"].url, "/v1/completions", body)
    params = answer["kv_transfer_params"]
    if params is not None:  # do not leave the lease to the tests that follow
        release = {"remote_request_id": params["remote_request_id"]}
        client.post(trio["prefill"].url + "/v1/kv/release", json=release)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == ""
    assert params is None
    assert_nothing_held(trio["prefill"], timeout=2.0)


@pytest.fixture(scope="module")
def routers(trio, tmp_path_factory) -> Iterator[dict]:
    """tandem routers over the trio's prefill and decode workers: the handoff flow, and the
    legs in sequence."""
    log_dir = tmp_path_factory.mktemp("routers")
    with running_routers(log_dir, trio["prefill"].url, trio["decode"].url) as routers:
        yield routers


def streamed(client: httpx.Client, url: str, body: dict) -> tuple[Completion, list[str]]:
    """A streamed completion and the tokens its logprobs name, chunk after chunk."""
    with client.stream("POST", url + "/v1/completions", json=with_defaults(body)) as response:
        assert response.status_code == 200, response.read()
        chunks = read_stream(response)
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    return Completion.from_chunks(chunks), [t for lp in logprobs if lp for t in lp["tokens"]]


def test_a_streamed_request_the_decode_leg_refuses_is_refused_by_the_handoff_router(
    client, trio, routers
):
    """max_tokens past the context with a long prompt: the prefill leg carries the client's
    max_tokens and its worker refuses it before computing the prompt (the decode leg, opened
    with it by the handoff router, refuses it too); the client gets that 400, as from `both`,
    not a stream that ends in an error, and nothing is held."""
    body = {"prompt": list(range(1000, 1500)), "max_tokens": 8000, "stream": True}
    expected = client.post(trio["both"].url + "/v1/completions", json=body, timeout=60)
    assert expected.status_code == 400
    answer = client.post(routers["handoff"].url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"] == expected.json()["error"]["message"]
    assert_nothing_held(trio["prefill"], trio["decode"])


@pytest.mark.parametrize(
    ("stop", "extra"),
    [
        ([" girl named"], {}),  # begun by the first token, completed by the second
        ([" girl named Bob"], {}),  # begun by the first token, never completed: held, then sent
        ([" named"], {}),  # the second token
        ([" girl named"], {"include_stop_str_in_output": True}),  # kept: nothing held
    ],
)
def test_stop_strings_and_logprobs_through_the_router(client, trio, routers, stop, extra):
    """Streamed through the router (handoff, and the legs in sequence), with stop strings
    that the first token (" girl") begins: the `both` worker's text, tokens and finish, and
    each token's logprobs once (the router sends the first token's from the prefill answer)."""
    body = {"prompt": "Once upon a time, there was a little", "max_tokens": 6, "stop": stop}
    body.update(temperature=0.0, logprobs=1, stream=True, **extra)
    expected = streamed(client, trio["both"].url, body)
    assert expected[0].token_ids and expected[1]
    for name, router in routers.items():
        assert streamed(client, router.url, body) == expected, name
    assert_nothing_held(trio["prefill"], trio["decode"])


@pytest.fixture(scope="module")
def vllm_router(trio, tmp_path_factory) -> Iterator[str]:
    binary = shutil.which("vllm-router")
    if binary is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-router") / "router.log"
    command = [binary, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prefill", trio["prefill"].url, "--decode", trio["decode"].url]
    command += ["--policy", "round_robin", "--disable-retries", "--disable-circuit-breaker"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_router_serves_several_choices(client, trio, vllm_router, stream: bool):
    body = {"prompt": PROMPTS[3], "max_tokens": 5, "n": 2, "stream": stream, **SAMPLING["seeded"]}
    routed = every_choice(client, vllm_router, "/v1/completions", body)
    assert routed == every_choice(client, trio["both"].url, "/v1/completions", body)
    assert len(routed) == 2
    assert_nothing_held(trio["prefill"], trio["decode"])


def test_a_prompt_scored_only_through_the_router(client, trio, routers):
    """echo with max_tokens 0 goes whole to the decode worker: the `both` worker's answer."""
    body = {"prompt": "Once upon a time", "max_tokens": 0, "echo": True, "logprobs": 1}
    expected = client.post(trio["both"].url + "/v1/completions", json=body).json()
    for router in routers.values():
        answer = client.post(router.url + "/v1/completions", json=body).json()
        assert answer["choices"][0]["text"] == "Once upon a time" == expected["choices"][0]["text"]
        logprobs, reference = answer["choices"][0]["logprobs"], expected["choices"][0]["logprobs"]
        assert logprobs["tokens"] == reference["tokens"]
        assert logprobs["token_logprobs"][1:] == pytest.approx(
            reference["token_logprobs"][1:], abs=1e-4
        )
        assert answer["usage"] == expected["usage"]
    assert_nothing_held(trio["prefill"], trio["decode"])


ROUTED_CASES = {
    "collected": [
        ("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 6, **SAMPLING["greedy"]}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, **SAMPLING["seeded"]}),
    ],
    "streamed": [
        ("/v1/completions", {"prompt": PROMPTS[8], "max_tokens": 6, **SAMPLING["seeded"]}),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 10, **SAMPLING["greedy"]},
        ),
    ],
}


@pytest.mark.parametrize("mode", ROUTED_CASES)
def test_vllm_router_gives_the_both_answers(client, trio, vllm_router, mode: str):
    for path, body in ROUTED_CASES[mode]:
        body = dict(body, stream=mode == "streamed")
        routed = run_direct(client, vllm_router, path, body)
        assert routed == run_direct(client, trio["both"].url, path, body), (path, body)
    assert_nothing_held(trio["prefill"], trio["decode"])


HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
ONCE = {"prompt": "Once upon a time", "temperature": 0.0}
# Bodies whose answers hold more than tokens and text: each token's logprobs and text_offset,
# the stop that ended the output, an echoed prompt or message; through the router, every field
# as `both`.
FIELD_CASES = {
    "logprobs": ("/v1/completions", dict(ONCE, max_tokens=6, logprobs=2)),
    "logprobs, a stop the first token begins": (
        "/v1/completions",
        dict(ONCE, max_tokens=3, stop=[", a"], logprobs=1),
    ),
    "chat logprobs": (
        "/v1/chat/completions",
        {
            "messages": HAIKU,
            "max_tokens": 6,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    ),  # fmt: skip
    "echo": ("/v1/completions", dict(ONCE, max_tokens=3, echo=True)),
    "chat echo": (
        "/v1/chat/completions",
        {
            "messages": [*HAIKU, {"role": "assistant", "content": "Waves"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
            "max_tokens": 6,
            "temperature": 0.0,
        },
    ),
    "stopped on the first token": ("/v1/completions", dict(ONCE, max_tokens=8, stop=[","])),
    "chat stopped on the first token": (
        "/v1/chat/completions",
        {"messages": HAIKU, "max_tokens": 6, "temperature": 0.0, "stop": ["The"]},
    ),
    "max_completion_tokens first": (
        "/v1/completions",
        dict(ONCE, max_tokens=1, max_completion_tokens=5),
    ),
}


def answer_fields(response: httpx.Response, stream: bool) -> dict[str, Any]:
    """What a client reads of one choice, whole or from its chunks in order: text, token ids,
    finish and stop reason, and per token its logprob entry (chat) or legacy lists."""
    assert response.status_code == 200, response.read()
    if stream:
        choices = [choice for chunk in read_stream(response) for choice in chunk["choices"]]
    else:
        choices = json.loads(response.read())["choices"]
    fields: dict[str, Any] = {"text": "", "token_ids": [], "logprobs": []}
    for choice in choices:
        holder = choice.get("delta" if stream else "message") or choice
        fields["text"] += holder.get("content") or holder.get("text") or ""
        fields["token_ids"] += choice.get("token_ids") or []
        logprobs = choice.get("logprobs") or {}
        if "content" in logprobs:
            fields["logprobs"] += [
                (e["token"], round(e["logprob"], 3), [t["token"] for t in e["top_logprobs"]])
                for e in logprobs["content"] or []
            ]
        else:
            tokens, offsets = logprobs.get("tokens", []), logprobs.get("text_offset", [])
            values = [round(value, 3) for value in logprobs.get("token_logprobs", [])]
            fields["logprobs"] += list(zip(tokens, values, offsets, strict=True))
        if choice.get("finish_reason") is not None:
            fields["finish"] = (choice["finish_reason"], choice.get("stop_reason"))
    return fields


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", FIELD_CASES)
def test_every_field_of_an_answer_through_the_router(client, trio, routers, case, stream):
    path, body = FIELD_CASES[case]
    body = dict(body, stream=stream, return_token_ids=True)

    def fields(url: str) -> dict[str, Any]:
        with client.stream("POST", url + path, json=body, timeout=120) as response:
            return answer_fields(response, stream)

    expected = fields(trio["both"].url)
    assert expected["token_ids"] and expected["finish"][0]
    if body.get("logprobs"):
        assert len(expected["logprobs"]) == len(expected["token_ids"])
    if stream and path == "/v1/completions":  # streamed text_offsets are the whole answer's
        whole = client.post(trio["both"].url + path, json=dict(body, stream=False)).json()
        assert [e[2] for e in expected["logprobs"]] == (
            (whole["choices"][0]["logprobs"] or {}).get("text_offset", []))  # fmt: skip
    for name, router in routers.items():
        assert fields(router.url) == expected, name
    assert_nothing_held(trio["prefill"], trio["decode"])


CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", dict(ONCE, max_tokens=6)),
        ("/v1/chat/completions", {"messages": HAIKU, "max_tokens": 6, "temperature": 0.0}),
        ("/v1/completions", dict(ONCE, max_tokens=8, stop=[","])),  # the prefill answers alone
    ],
    ids=["completion", "chat", "stopped on the first token"],
)
def test_continuous_usage_through_the_router(client, trio, routers, path, body):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far. The
    router's first chunk (the prefill's token) and the decode's chunks count as `both` does:
    the same completion_tokens, in order (less `both`'s role chunk, which counts 0: the router
    sends the role with the first token; and a count repeated by a chunk that only ends the
    answer, as the router's after a first token that ends it), the same usage at the end."""
    body = dict(body, stream=True, stream_options=CONTINUOUS_USAGE)

    def counts(url: str) -> tuple[list[int], dict[str, int]]:
        with client.stream("POST", url + path, json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            *chunks, last = read_stream(response)
        prompt_tokens = last["usage"]["prompt_tokens"]
        assert last["choices"] == [] and all(c["choices"] for c in chunks)
        assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
        running = [c["usage"]["completion_tokens"] for c in chunks]
        assert running == sorted(running) and running[-1] == last["usage"]["completion_tokens"]
        final = {name: last["usage"][name] for name in ("prompt_tokens", "completion_tokens")}
        return [count for count in dict.fromkeys(running) if count], final

    expected = counts(trio["both"].url)
    assert expected[0][0] == 1
    for name, router in routers.items():
        assert counts(router.url) == expected, name
    assert_nothing_held(trio["prefill"], trio["decode"])
    alone = dict(body, stream_options={"continuous_usage_stats": True})  # no include_usage
    with client.stream("POST", trio["both"].url + path, json=alone, timeout=120) as response:
        assert not any("usage" in chunk for chunk in read_stream(response))
