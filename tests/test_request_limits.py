"""Request limits: the body limits of both HTTP servers (`tandem.limits`), the prompt-length
bound and the worker's field limits, against a real worker and a real router in front of it on
the tiny checkpoint (with a small byte-level BPE tokenizer and a plain chat template). Every
hostile body a security probe sent is a 4xx OpenAI error object that names what to change,
never a 5xx, answered promptly, and the servers serve a normal request after it.

Also: the body-limit middleware on a tiny Starlette app and on raw ASGI messages, the nesting
measure against a recursive reference, counted repetitions against worked examples, and the
prompt-length bound against the tokenizer's own token counts.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pd_fixtures import running_processes
from tandem.engine.processor import longest_token_bytes, shrink_factor
from tandem.engine.structured_output import largest_repetition
from tandem.limits import BodyLimit, RequestRefused, decode_json, nests_deeper
from tandem.router.cli import add_parser as add_router_parser
from tandem.server.cli import add_parser as add_worker_parser
from tiny_models import byte_level_bpe
from worker_fixtures import WorkerProcess, free_port, start_tandem, start_worker

MIB = 1024 * 1024
WORKER_BODY_LIMIT = 64 * MIB  # over the default, so that a 50 MB prompt reaches the tokenizer
ROUTER_DEPTH = 64  # the router's limit; the worker keeps the default, 128
MAX_WAITING = 64
MAX_STOP_STRINGS = 16
MAX_MODEL_LEN = 1024  # the tiny checkpoint's
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Renders for seconds (the sandbox caps a range at 100,000 items): a long tokenization's stand-in.
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(300) %}{% endfor %}{% endfor %}x"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    corpus = ["the quick brown fox jumps over the lazy dog " * 4, " " * 64, "#" * 48] * 20
    core = byte_level_bpe(corpus, 400)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")


@pytest.fixture(scope="module")
def servers(tiny_checkpoints, tokenizer, tmp_path_factory) -> Iterator[dict[str, WorkerProcess]]:
    """One worker on the tiny checkpoint (with the tokenizer) and a router in front of it."""
    root = tmp_path_factory.mktemp("limits")
    checkpoint = root / "checkpoint"
    shutil.copytree(tiny_checkpoints["llama-gqa"], checkpoint)
    tokenizer.save_pretrained(checkpoint)
    worker = functools.partial(
        start_worker,
        root,
        *("--max-request-body-bytes", str(WORKER_BODY_LIMIT), "--max-waiting", "64"),
        *("--max-stop-strings", str(MAX_STOP_STRINGS), "--num-kv-blocks", "256"),
        *("--chat-template", TEMPLATE, "--trust-request-chat-template"),
        model=str(checkpoint),
        port=free_port(),
    )
    worker_url = f"http://127.0.0.1:{worker.keywords['port']}"
    router = functools.partial(
        start_tandem,
        root,
        "router",
        *("--worker", worker_url, "--max-request-json-depth", str(ROUTER_DEPTH)),
    )
    with running_processes({"worker": worker, "router": router}) as started:
        yield started


def post(url: str, path: str, body, timeout: float = 120) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(url + path, json=body, timeout=timeout)
    headers = {"content-type": "application/json"}
    return httpx.post(url + path, content=body, headers=headers, timeout=timeout)


def assert_refused(response: httpx.Response, status: int, *words: str) -> str:
    """A refusal with this status: an OpenAI error object whose message holds the words."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


def assert_serves(url: str) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    response = post(url, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# -- the body limits on real servers --------------------------------------------------------------


def chunks(total: int, size: int = MIB) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length), `total` bytes of an unfinished JSON string."""
    yield b'{"prompt": "'
    for start in range(0, total, size):
        yield b"x" * min(size, total - start)


@pytest.mark.parametrize("server, limit", [("worker", WORKER_BODY_LIMIT), ("router", 32 * MIB)])
@pytest.mark.parametrize("sent", ["with its length", "chunked"])
def test_an_oversized_body_is_413_whatever_its_framing(servers, server, limit, sent):
    url = servers[server].url
    if sent == "chunked":
        content = chunks(limit + MIB)
    else:  # the router's case is the probe's 50 MB prompt
        content = b'{"prompt": "' + b"x" * (limit + MIB) + b'"}'
    started = time.monotonic()
    response = httpx.post(url + COMPLETIONS, content=content, timeout=120)
    assert time.monotonic() - started < 10
    assert_refused(response, 413, str(limit), "--max-request-body-bytes")
    assert_serves(url)


@pytest.mark.parametrize("server, depth", [("worker", 128), ("router", ROUTER_DEPTH)])
@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    ],
    ids=["100,000 [", "50,000 nested objects", "a nested prompt"],
)
def test_a_body_nested_past_the_limit_is_400(servers, server, depth, body):
    response = post(servers[server].url, COMPLETIONS, body)
    assert_refused(response, 400, f"nests deeper than {depth} levels", "--max-request-json-depth")
    assert_serves(servers[server].url)


@pytest.mark.parametrize("server, depth", [("worker", 128), ("router", ROUTER_DEPTH)])
def test_a_body_nested_to_the_limit_is_served_and_one_level_more_is_not(servers, server, depth):
    def body(levels: int) -> bytes:  # the object is the first level, the extra field the rest
        extra = b"[" * (levels - 1) + b"]" * (levels - 1)
        return b'{"prompt": "the fox", "max_tokens": 1, "extra": ' + extra + b"}"

    assert post(servers[server].url, COMPLETIONS, body(depth)).status_code == 200
    assert_refused(post(servers[server].url, COMPLETIONS, body(depth + 1)), 400, "nests deeper")


def test_a_body_that_is_not_utf8_is_400(servers):
    response = post(servers["worker"].url, COMPLETIONS, b'{"prompt": "\xff\xfe"}')
    assert_refused(response, 400, "not valid JSON")


# -- prompts that cannot fit the context ----------------------------------------------------------


def test_a_50_mb_prompt_is_refused_at_once_and_costs_no_memory(servers):
    """The probe's prompt: tokenized whole, it took gigabytes and got the worker killed."""
    worker = servers["worker"]
    body = b'{"prompt": "' + b"the lazy dog " * (50 * MIB // 13) + b'"}'
    before = rss_bytes(worker.process.pid)
    started = time.monotonic()
    response = post(worker.url, COMPLETIONS, body)
    elapsed = time.monotonic() - started
    assert_refused(response, 400, "prompt", f"{MAX_MODEL_LEN} tokens (max_model_len)")
    assert elapsed < 5, elapsed  # uploading and parsing 50 MB; tokenizing it took far longer
    assert rss_bytes(worker.process.pid) - before < 300 * MIB
    assert_serves(worker.url)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "y" * (5 * MIB)}],
        [{"role": "user", "content": "hi there"}] * 20_000,
    ],
    ids=["one long message", "20,000 messages"],
)
def test_chat_messages_that_cannot_fit_are_refused_before_the_template(servers, messages):
    started = time.monotonic()
    response = post(servers["router"].url, CHAT, {"messages": messages, "max_tokens": 1})
    assert_refused(response, 400, "messages", "max_model_len")
    assert time.monotonic() - started < 5


def test_a_token_id_prompt_longer_than_the_context_is_refused_before_its_ids_are_read(servers):
    body = {"prompt": [10**9] * (MAX_MODEL_LEN + 1), "max_tokens": 1}
    message = assert_refused(post(servers["worker"].url, COMPLETIONS, body), 400, "context")
    assert "vocabulary" not in message


def test_a_prompt_within_the_bound_but_over_the_context_is_refused_after_tokenizing(servers):
    response = post(servers["worker"].url, COMPLETIONS, {"prompt": "the fox " * 2000})
    assert_refused(response, 400, "tokens but the context length is")


def test_health_answers_while_a_chat_template_renders(servers):
    """The template and the tokenizer run off the event loop: /health stays prompt."""
    worker = servers["worker"]
    body = {"messages": HI, "max_tokens": 1, "chat_template": SLOW_TEMPLATE}
    done: dict[str, float] = {}

    def slow_request() -> None:
        started = time.monotonic()
        assert post(worker.url, CHAT, body).status_code == 200
        done["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=slow_request)
    thread.start()
    time.sleep(0.2)
    slowest = 0.0
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(worker.url + "/health", timeout=30).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.05)
    thread.join()
    assert done["seconds"] > 1.0, "the template rendered too fast to tell"
    assert slowest < done["seconds"] / 2, (slowest, done)


# -- the worker's field limits --------------------------------------------------------------------


def tools(count: int, properties: int) -> list[dict]:
    fields = {f"p{i}": {"type": "string"} for i in range(properties)}
    schema = {"type": "object", "properties": fields}
    function = {"name": "f", "parameters": schema}
    return [{"type": "function", "function": dict(function, name=f"f{i}")} for i in range(count)]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


BIG_SCHEMA = schema_format(tools(1, 4000)[0]["function"]["parameters"])
REPEATING_PATTERN = schema_format({"type": "string", "pattern": "^a{1000000}$"})
BYTES_FLAG = "--max-structured-output-bytes"
REPETITION_FLAG = "--max-structured-output-repetition"
FIELD_CASES = [
    ("stop", {"stop": [f"s{i}" for i in range(5000)]}, ("stop", f"at most {MAX_STOP_STRINGS}")),
    ("logit-bias", {"logit_bias": {str(i): 1 for i in range(5000)}}, ("--max-logit-bias",)),
    ("choice-bytes", {"guided_choice": ["x" * 100] * 1000}, ("choice", BYTES_FLAG)),
    ("regex-bytes", {"guided_regex": "a" * 70_000}, ("regex", BYTES_FLAG)),
    ("grammar-bytes", {"guided_grammar": "start: " + "|".join(['"w"'] * 30_000)}, (BYTES_FLAG,)),
    ("schema-bytes", {"response_format": BIG_SCHEMA}, ("response_format", BYTES_FLAG)),
    ("tools-bytes", {"tools": tools(100, 30), "tool_choice": "required"}, ("tools", BYTES_FLAG)),
    ("regex-repetition", {"guided_regex": "(a{1000}){1000}"}, ("1000000 times", REPETITION_FLAG)),
    ("pattern-repetition", {"response_format": REPEATING_PATTERN}, ("1000000 times",)),
    ("grammar-repetition", {"guided_grammar": 'start: "a"~1000000'}, ("1000000 times",)),
    ("bad-regex", {"guided_regex": "("}, ("regex", "not valid")),
    ("bad-grammar", {"guided_grammar": "start: ??"}, ("grammar", "not valid")),
    ("deep-schema-text", {"guided_json": "[" * 5000 + "]" * 5000}, ("JSON schema", "not valid")),
    ("n", {"n": 10**6}, (f"n must be at most {MAX_WAITING}",)),
]  # fmt: skip


@pytest.mark.parametrize("case, fields, words", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_a_field_over_its_limit_is_400_through_the_router(servers, case, fields, words):
    body = {"messages": HI, "max_tokens": 2, **fields}
    assert_refused(post(servers["router"].url, CHAT, body), 400, *words)


def test_field_limits_are_the_flags_values(servers):
    url = servers["worker"].url
    stop = {"messages": HI, "max_tokens": 1, "stop": ["a"] * MAX_STOP_STRINGS}
    assert post(url, CHAT, stop).status_code == 200
    stop["stop"].append("b")
    assert_refused(post(url, CHAT, stop), 400, f"{MAX_STOP_STRINGS + 1} strings")
    bias = {"prompt": [5, 6], "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(512)}}
    assert post(url, COMPLETIONS, bias).status_code == 200  # within the default of 1024


@pytest.mark.parametrize("server", ["worker", "router"])
def test_ten_thousand_choices_are_served(servers, server):
    """They were a 500 (llguidance's 2000 items in a row), a 503 through the router."""
    choices = [f"c{i}" for i in range(10_000)]
    body = {"messages": HI, "max_tokens": 8, "temperature": 0, "guided_choice": choices}
    response = post(servers[server].url, CHAT, body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in choices


def test_a_batch_larger_than_the_queue_is_400_at_once(servers):
    """It was a 503 after the first MAX_WAITING of its prompts had run."""
    body = {"prompt": [[5, 6]] * (MAX_WAITING // 2 + 1), "n": 2, "max_tokens": 1}
    response = post(servers["worker"].url, COMPLETIONS, body)
    assert_refused(response, 400, f"queue holds ({MAX_WAITING}", "--max-waiting")
    body["prompt"] = [[5, 6]] * (MAX_WAITING // 2)
    assert post(servers["worker"].url, COMPLETIONS, body).status_code == 200


# -- the body-limit middleware --------------------------------------------------------------------


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"received": len(await request.body())})


def test_the_middleware_on_a_starlette_app():
    app = BodyLimit(Starlette(routes=[Route("/", echo, methods=["POST"])]), max_bytes=100)
    with TestClient(app) as client:
        assert client.post("/", content=b"x" * 100).json() == {"received": 100}
        assert client.post("/", content=iter([b"x" * 60, b"y" * 40])).json() == {"received": 100}
        for content in (b"x" * 101, iter([b"x" * 60, b"y" * 41])):
            response = client.post("/", content=content)
            assert response.status_code == 413
            error = response.json()["error"]
            assert error["code"] == "request_too_large" and "at most 100 bytes" in error["message"]


def run_asgi(max_bytes: int, headers: list, messages: list[dict]) -> tuple[list, list, list]:
    """Call BodyLimit on raw ASGI messages: what the app received, what was sent, and the
    messages left unread."""
    received, sent, pending = [], [], list(messages)

    async def app(scope, receive, send) -> None:
        received.append(await receive())
        received.append(await receive())  # after the body: the server's next message

    async def receive() -> dict:
        return pending.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    asyncio.run(BodyLimit(app, max_bytes)(scope, receive, send))
    return received, sent, pending


def body_messages(*pieces: bytes) -> list[dict]:
    last = len(pieces) - 1
    return [
        {"type": "http.request", "body": piece, "more_body": index < last}
        for index, piece in enumerate(pieces)
    ]


DISCONNECT = {"type": "http.disconnect"}


def test_the_middleware_refuses_by_content_length_before_reading():
    messages = body_messages(b"x" * 10, b"y" * 10) + [DISCONNECT]
    received, sent, pending = run_asgi(15, [(b"content-length", b"20")], messages)
    assert received == [] and pending == messages  # nothing read, the app never called
    assert sent[0]["status"] == 413 and b"has 20 bytes" in sent[1]["body"]


def test_the_middleware_stops_reading_a_chunked_body_once_past_the_limit():
    messages = body_messages(b"x" * 10, b"y" * 10, b"z" * 10) + [DISCONNECT]
    received, sent, pending = run_asgi(15, [], messages)
    assert received == [] and sent[0]["status"] == 413
    assert pending == messages[2:]  # the third chunk was never read


def test_the_middleware_passes_a_body_within_the_limit_whole():
    messages = body_messages(b"x" * 10, b"y" * 5) + [DISCONNECT]
    received, sent, pending = run_asgi(15, [(b"content-length", b"15")], messages)
    assert received == [
        {"type": "http.request", "body": b"x" * 10 + b"y" * 5, "more_body": False},
        DISCONNECT,
    ]
    assert sent == [] and pending == []


def test_the_middleware_drops_a_request_whose_client_left_mid_body():
    partial = {"type": "http.request", "body": b"x" * 10, "more_body": True}
    received, sent, _ = run_asgi(15, [], [partial, DISCONNECT])
    assert received == [] and sent == []


# -- nesting, repetitions and the prompt bound against references ---------------------------------


def reference_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(reference_depth, value), default=0)
    return 0


def random_json(rng: random.Random, budget: int):
    kind = rng.random()
    if budget <= 0 or kind < 0.3:
        return rng.choice([1, "s", None, 2.5, True])
    items = [random_json(rng, budget - rng.randint(1, 3)) for _ in range(rng.randint(0, 3))]
    return items if kind < 0.65 else {f"k{i}": item for i, item in enumerate(items)}


def test_nests_deeper_agrees_with_a_recursive_measure():
    rng = random.Random(7)
    for _ in range(300):
        value = random_json(rng, rng.randint(0, 12))
        depth = reference_depth(value)
        for limit in range(1, 14):
            assert nests_deeper(value, limit) == (depth > limit), (value, limit)


@pytest.mark.parametrize("decode", [json.loads, msgspec.json.decode], ids=["json", "msgspec"])
def test_decode_json_refuses_deep_bodies_and_keeps_flat_ones(decode):
    for body in (b"[" * 100_000, b"[" * 300 + b"]" * 300, b'{"a":' * 50_000):
        with pytest.raises(RequestRefused, match="nests deeper than 128 levels"):
            decode_json(body, decode, 128)
    flat = b"[" + b",".join([b"[1]"] * 10_000) + b"]"  # many brackets, two levels
    assert len(decode_json(flat, decode, 2)) == 10_000
    with pytest.raises(ValueError):  # malformed JSON is the decoder's error, as it was
        decode_json(b"[1,", decode, 128)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("abc", 0),
        ("a{5}", 5),
        ("a{3,}", 3),
        ("a{2,7}b{9}", 9),
        ("(a{10}|b){20}", 200),
        ("((a{2}){3}){4}", 24),
        (r"\{5\}", 0),  # escaped braces are literal text
        ("[{]{7}", 7),
        ('start: "a"{1000000}', 1_000_000),
        ('start: "a"{,70000} "b"~20000 ("c"~3..500)~4', 70_000),
        ("a{}b{,}", 0),
        ('{"type": "string", "pattern": "^(ab{10}){100}$"}', 1000),
    ],
)
def test_largest_repetition(text, expected):
    assert largest_repetition(text) == expected


def test_the_prompt_bound_holds_for_texts_that_pack_many_bytes_per_token(tokenizer):
    bound = longest_token_bytes(tokenizer)
    assert bound is not None
    rng = random.Random(3)
    texts = [" " * 5000, "#" * 5000, "\n" * 3000, "the quick brown fox " * 300, "😀é" * 500]
    texts += ["".join(chr(rng.randint(32, 0x2FFF)) for _ in range(2000)) for _ in range(3)]
    for text in texts:
        num_tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert len(text.encode()) <= num_tokens * bound, text[:20]


def test_no_prompt_bound_where_the_tokenizer_drops_or_fuses_text():
    wordlevel = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    fused = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>"))
    fused.model.fuse_unk = True
    dropping = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    dropping.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for core in (wordlevel, fused, dropping):
        assert longest_token_bytes(PreTrainedTokenizerFast(tokenizer_object=core)) is None
    nfkc = Tokenizer(models.BPE(vocab={"a": 0, "abc": 1}, merges=[]))
    nfkc.normalizer = normalizers.NFKC()  # "𝐀" (4 bytes) becomes "A"
    assert longest_token_bytes(PreTrainedTokenizerFast(tokenizer_object=nfkc)) == 4 * 3
    replace = {"type": "Replace", "pattern": {"String": "ab"}, "content": "c"}
    assert shrink_factor({"type": "Sequence", "normalizers": [replace]}) == 2.0
    assert shrink_factor(dict(replace, pattern={"Regex": " +"})) is None


# -- the flags ------------------------------------------------------------------------------------


def parse(add_parser, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(argv)


def test_both_clis_take_the_body_limits_and_the_worker_the_field_limits():
    router = parse(add_router_parser, "router", "--max-request-body-bytes", "1000")
    assert (router.max_request_body_bytes, router.max_request_json_depth) == (1000, 128)
    worker = parse(
        add_worker_parser, "worker", "--max-request-json-depth", "32", "--max-logit-bias", "5"
    )
    assert (worker.max_request_json_depth, worker.max_logit_bias) == (32, 5)
    assert worker.max_structured_output_bytes == 64 * 1024
    for bad in (("--max-request-json-depth", "513"), ("--max-request-body-bytes", "0")):
        with pytest.raises(SystemExit):
            parse(add_router_parser, "router", *bad)
