"""The worker's OpenAI API end to end: one real `tandem worker` on the default model (CPU, with
the hermes tool call parser) serves the whole module and is driven by the official `openai`
client (sync and async) and by raw HTTP.

References are independent of the server: the offline engine (`tandem.LLM`, loaded in this
process while the worker boots) for texts, token ids and logprobs under the same sampling
settings, and the tokenizer for prompt token counts. Also here: 64 concurrent streams, the
Prometheus metrics, client disconnects (blocks return to the pool) and every bad input a client
can send (a 4xx with an OpenAI-style error object, and the server keeps serving).
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

import tandem
from tandem import DEFAULT_MODEL, LLM, SamplingParams
from tandem.engine.structured_output import StructuredOutput
from tandem.server.app import build_app
from tandem.server.main import read_chat_template
from tandem.server.metrics import WorkerMetrics
from tandem.server.openai.writer import LatencyTracker
from tandem.server.settings import ServerSettings
from worker_fixtures import read_metrics, running_worker, wait_for_metric

MODEL = DEFAULT_MODEL
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
YES_OR_NO = [{"role": "user", "content": "Reply with one word: yes or no?"}]  # greedy: "Yes."
FRUITS = "Here is a list of fruits: apples, bananas,"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
FRUIT_CHOICES = ["apples", "pears", "lemons"]
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ANSWER_REGEX = r"(yes|no)\. [A-Z][a-z ]{0,20}\."
BLOCKS_USED = "tandem_kv_cache_blocks_used"


@pytest.fixture(scope="module")
def reference_future():
    """The offline engine, loading in a thread so that it overlaps the worker's start-up; it runs
    with one intra-op thread, as the worker does (see worker_fixtures)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=1) as executor:
            yield executor.submit(LLM, MODEL)
    finally:
        torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def worker(tmp_path_factory, reference_future):
    # Depends on reference_future only to start the reference loading first.
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with running_worker(tmp_path_factory.mktemp("worker"), *flags) as process:
        yield process


@pytest.fixture(scope="module")
def llm(reference_future) -> LLM:
    return reference_future.result()


@pytest.fixture(scope="module")
def client(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
async def async_client(worker):
    async with openai.AsyncOpenAI(
        base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def chat_prompt_ids(llm: LLM, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template rendered, then tokenized without special tokens added."""
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer(text, add_special_tokens=False).input_ids


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and isinstance(prompt[0], dict)


def offline_batch(llm: LLM, requests: list[tuple[Any, dict[str, Any]]]) -> list[list]:
    """The offline engine's outputs (one per sample) for each (prompt or chat, SamplingParams
    fields), run as one batch of prompts and one of chats."""
    results: list[list] = [[] for _ in requests]
    for chat in (False, True):
        indices = [i for i, (prompt, _) in enumerate(requests) if is_chat(prompt) == chat]
        if not indices:
            continue
        prompts = [requests[i][0] for i in indices]
        params = [SamplingParams(**requests[i][1]) for i in indices]
        outputs = llm.chat(prompts, params) if chat else llm.generate(prompts, params)
        for index, output in zip(indices, outputs, strict=True):
            results[index] = output.outputs
    return results


def offline(llm: LLM, prompt: Any, **params: Any) -> list:
    return offline_batch(llm, [(prompt, params)])[0]


def assert_serving(worker) -> None:
    """The worker still answers a real request and holds no KV blocks afterwards."""
    body = {"prompt": "One, two,", "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert wait_for_metric(worker.url, BLOCKS_USED, 0.0) == 0.0


# -- endpoints and the openai client ------------------------------------------------------------


def test_models_health_and_metric_families(worker, client):
    assert [model.id for model in client.models.list().data] == [MODEL]
    health = httpx.get(f"{worker.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(f"{worker.url}/version", timeout=10).json() == {"version": tandem.__version__}

    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    for name, kind in [
        ("tandem_kv_cache_blocks_used", "gauge"),
        ("tandem_kv_cache_blocks_total", "gauge"),
        ("tandem_requests_running", "gauge"),
        ("tandem_requests_waiting", "gauge"),
        ("tandem_prefix_cache_hit_rate", "gauge"),
        ("tandem_time_to_first_token_seconds", "histogram"),
        ("tandem_inter_token_latency_seconds", "histogram"),
        ("tandem_e2e_request_latency_seconds", "histogram"),
        ("tandem_prompt_tokens_total", "counter"),
        ("tandem_generation_tokens_total", "counter"),
    ]:
        assert f"# TYPE {name} {kind}" in text, name
    assert read_metrics(worker.url)["tandem_kv_cache_blocks_total"] > 0


def test_tokenize_and_detokenize_agree_with_the_tokenizer_and_the_usage(worker, client, llm):
    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(worker.url + path, json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    expected = llm.tokenizer(FRUITS).input_ids
    answer = post("/tokenize", {"prompt": FRUITS, "model": MODEL, "return_token_strs": True})
    assert answer["tokens"] == expected and answer["count"] == len(expected)
    assert answer["token_strs"] == llm.tokenizer.convert_ids_to_tokens(expected)
    assert answer["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    usage = client.completions.create(model=MODEL, prompt=FRUITS, max_tokens=1).usage
    assert usage.prompt_tokens == answer["count"]

    chat = post("/tokenize", {"messages": FRANCE})
    assert chat["tokens"] == chat_prompt_ids(llm, FRANCE) and chat["token_strs"] is None
    usage = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"]

    assert post("/detokenize", {"tokens": expected})["prompt"] == llm.tokenizer.decode(expected)
    assert post("/detokenize", {"tokens": []})["prompt"] == ""


def test_chat_can_continue_the_assistants_last_message(worker, client, llm):
    """continue_final_message renders the last (assistant) message open, without a new turn;
    /tokenize renders messages the same way."""
    opening = "The capital of France is"
    messages = [*FRANCE, {"role": "assistant", "content": opening}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, **options)
    assert text.endswith(opening)
    expected = llm.tokenizer(text, add_special_tokens=False).input_ids
    tokenized = httpx.post(worker.url + "/tokenize", json={"messages": messages, **options})
    assert tokenized.json()["tokens"] == expected
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6, extra_body=options
    )
    assert answer.usage.prompt_tokens == len(expected)
    (reference,) = offline(llm, expected, temperature=0, max_tokens=6)
    assert answer.choices[0].message.content == reference.text
    assert "Paris" in reference.text

    both = {"add_generation_prompt": True, "continue_final_message": True}
    response = httpx.post(worker.url + "/v1/chat/completions", json={"messages": messages, **both})
    assert response.status_code == 400 and "continue_final_message" in response.text


def test_chat_echo_opens_the_answer_with_the_assistants_last_message(worker, client):
    """vLLM's chat echo: the content opens with the last message's text when it is the
    assistant's (a chunk of its own after the role's when streamed); after a user's message
    the answer is as without echo."""
    opening = "The capital of France is"
    continued = [*FRANCE, {"role": "assistant", "content": opening}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    for messages, extra, echoed in ((continued, options, opening), (FRANCE, {}, "")):
        request = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 6}
        plain = client.chat.completions.create(**request, extra_body=extra)
        content = plain.choices[0].message.content
        answer = client.chat.completions.create(**request, extra_body=extra | {"echo": True})
        assert answer.choices[0].message.content == echoed + content
        counts = ("prompt_tokens", "completion_tokens")  # the second's prompt is cached
        assert [getattr(answer.usage, c) for c in counts] == [
            getattr(plain.usage, c) for c in counts
        ]
        stream = client.chat.completions.create(
            **request, stream=True, extra_body=extra | {"echo": True}
        )
        deltas = [chunk.choices[0].delta for chunk in stream]
        assert deltas[0].role == "assistant" and deltas[0].content == ""
        if echoed:
            assert deltas[1].content == echoed
        assert "".join(delta.content or "" for delta in deltas) == echoed + content


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "hi", "messages": FRANCE}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": "hi", "model": "gpt-5"}, 404, "model"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ("/tokenize", {"messages": FRANCE, "chat_template": "{{ x }}"}, 400, "chat_template"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "hello"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt-5"}, 404, "model"),
    ],
)
def test_bad_tokenize_requests_get_4xx(worker, path, body, status, param):
    response = httpx.post(worker.url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert len(error["message"]) > 10 and error["param"] == param


def test_chat_about_france_says_paris_with_exact_usage(client, llm):
    response = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=32
    )
    (reference,) = offline(llm, FRANCE, temperature=0, max_tokens=32)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.text
    assert choice.finish_reason == reference.finish_reason == "stop"
    assert response.usage.prompt_tokens == len(chat_prompt_ids(llm, FRANCE))
    assert response.usage.completion_tokens == len(reference.token_ids)  # EOS included
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(reference.token_ids)


def test_streamed_completion_equals_non_streamed(client, llm):
    request = dict(model=MODEL, prompt=FRUITS, temperature=0.8, seed=11, max_tokens=10)
    whole = client.completions.create(**request, logprobs=0)
    chunks = list(
        client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    *token_chunks, usage_chunk = chunks
    streamed_text = "".join(c.choices[0].text for c in token_chunks)
    choice = whole.choices[0]
    assert streamed_text == choice.text
    assert token_chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage

    (reference,) = offline(llm, FRUITS, temperature=0.8, seed=11, max_tokens=10)
    assert choice.text == reference.text
    assert whole.usage.prompt_tokens == len(llm.tokenizer(FRUITS).input_ids)
    assert whole.usage.completion_tokens == len(choice.logprobs.tokens) == len(reference.token_ids)


async def test_async_client_streams_equal_non_streamed(async_client, llm):
    messages = [{"role": "user", "content": "Name three colors."}]
    chat = dict(model=MODEL, messages=messages, temperature=0.8, seed=5, max_tokens=8)
    chat["extra_body"] = {"ignore_eos": True}
    completion = dict(model=MODEL, prompt=FRUITS, temperature=0, max_tokens=6)
    usage_option = {"include_usage": True}

    async def collect(stream) -> list:
        return [chunk async for chunk in await stream]

    whole_chat, chat_chunks, whole_completion, completion_chunks = await asyncio.gather(
        async_client.chat.completions.create(**chat),
        collect(
            async_client.chat.completions.create(**chat, stream=True, stream_options=usage_option)
        ),
        async_client.completions.create(**completion),
        collect(async_client.completions.create(**completion, stream=True)),
    )

    assert chat_chunks[0].choices[0].delta.role == "assistant"
    *token_chunks, usage_chunk = chat_chunks
    content = "".join(c.choices[0].delta.content or "" for c in token_chunks)
    assert content == whole_chat.choices[0].message.content
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert whole_chat.choices[0].finish_reason == "length"
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens may differ
    assert [getattr(usage_chunk.usage, name) for name in counts] == [
        getattr(whole_chat.usage, name) for name in counts
    ]
    assert whole_chat.usage.prompt_tokens == len(chat_prompt_ids(llm, messages))
    assert whole_chat.usage.completion_tokens == 8

    streamed = "".join(c.choices[0].text for c in completion_chunks)
    assert streamed == whole_completion.choices[0].text
    chat_reference, completion_reference = offline_batch(
        llm,
        [
            (messages, {"temperature": 0.8, "seed": 5, "max_tokens": 8, "ignore_eos": True}),
            (FRUITS, {"temperature": 0, "max_tokens": 6}),
        ],
    )
    assert content == chat_reference[0].text
    assert streamed == completion_reference[0].text


# -- request fields against the offline engine --------------------------------------------------


async def test_request_fields_match_the_offline_engine(async_client, llm):
    (greedy,), (short_answer,) = offline_batch(
        llm, [(FRUITS, {"temperature": 0, "max_tokens": 12}), (YES_OR_NO, {"temperature": 0})]
    )
    tokens = greedy.token_ids
    stop_position = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop_id = tokens[stop_position]
    assert short_answer.finish_reason == "stop" and len(short_answer.token_ids) < 6

    # name -> (prompt or messages, request fields, SamplingParams of the same request)
    cases = {
        "greedy": (FRUITS, {"temperature": 0, "max_tokens": 12}, None),
        "token ids": (llm.tokenizer(FRUITS).input_ids, {"temperature": 0, "max_tokens": 12}, None),
        "top_k": (FRUITS, {"temperature": 1.0, "top_k": 3, "seed": 1, "max_tokens": 10}, None),
        "top_p": (FRUITS, {"temperature": 1.0, "top_p": 0.6, "seed": 2, "max_tokens": 10}, None),
        "min_p": (FRUITS, {"temperature": 1.5, "min_p": 0.3, "seed": 3, "max_tokens": 10}, None),
        "default temperature": (FRUITS, {"seed": 4, "max_tokens": 8}, None),
        "stop": (FRUITS, {"temperature": 0, "stop": [" lemons"], "max_tokens": 12}, None),
        "include_stop_str_in_output": (
            FRUITS,
            {"temperature": 0, "stop": [" lemons"], "include_stop_str_in_output": True},
            None,
        ),
        "stop_token_ids": (
            FRUITS,
            {"temperature": 0, "stop_token_ids": [stop_id], "max_tokens": 12},
            None,
        ),
        "max_completion_tokens": (
            FRUITS,
            {"temperature": 0, "max_tokens": 50, "max_completion_tokens": 5},
            {"temperature": 0, "max_tokens": 5},
        ),
        "n": (FRUITS, {"temperature": 0.9, "seed": 8, "n": 2, "max_tokens": 6}, None),
        "min_tokens": (YES_OR_NO, {"temperature": 0, "min_tokens": 6, "max_tokens": 8}, None),
        "ignore_eos": (YES_OR_NO, {"temperature": 0, "ignore_eos": True, "max_tokens": 7}, None),
        "chat seed": (YES_OR_NO, {"temperature": 1.2, "seed": 9, "max_tokens": 6}, None),
        "penalties": (
            FRUITS,
            {
                "temperature": 0,
                "frequency_penalty": 1.5,
                "presence_penalty": 1.0,
                "repetition_penalty": 1.3,
                "max_tokens": 12,
            },
            None,
        ),  # fmt: skip
        "logit_bias": (
            FRUITS,
            {"temperature": 0, "logit_bias": {str(tokens[0]): -100}, "max_tokens": 4},
            {"temperature": 0, "logit_bias": {tokens[0]: -100}, "max_tokens": 4},
        ),
        "response_format": (
            FRANCE,
            {"temperature": 0, "max_tokens": 48, "response_format": CITY_FORMAT},
            {"temperature": 0, "max_tokens": 48, "structured_output": StructuredOutput(CITY)},
        ),
        "tools with tool_choice none": (  # the default model's template shows no tools
            FRANCE,
            {"temperature": 0, "max_tokens": 8, "tools": WEATHER_TOOLS, "tool_choice": "none"},
            {"temperature": 0, "max_tokens": 8},
        ),
        "structured_outputs choice": (
            FRUITS,
            {"temperature": 0, "structured_outputs": {"choice": FRUIT_CHOICES}},
            {"temperature": 0, "structured_output": StructuredOutput(choice=FRUIT_CHOICES)},
        ),
        "guided_regex": (
            YES_OR_NO,
            {"temperature": 1.0, "seed": 3, "max_tokens": 48, "guided_regex": ANSWER_REGEX},
            {
                "temperature": 1.0,
                "seed": 3,
                "max_tokens": 48,
                "structured_output": StructuredOutput(regex=ANSWER_REGEX),
            },
        ),
    }
    openai_fields = {
        "temperature", "top_p", "seed", "stop", "max_tokens", "n", "frequency_penalty",
        "presence_penalty", "logit_bias",
    }  # fmt: skip

    async def ask(prompt, fields: dict[str, Any]):
        known = {k: v for k, v in fields.items() if k in openai_fields}
        extra = {k: v for k, v in fields.items() if k not in openai_fields}
        extra["return_token_ids"] = True
        if isinstance(prompt[0], dict):
            return await async_client.chat.completions.create(
                model=MODEL, messages=prompt, extra_body=extra, **known
            )
        return await async_client.completions.create(
            model=MODEL, prompt=prompt, extra_body=extra, **known
        )

    responses = dict(
        zip(
            cases,
            await asyncio.gather(*(ask(prompt, fields) for prompt, fields, _ in cases.values())),
            strict=True,
        )
    )
    all_references = offline_batch(
        llm, [(prompt, params or fields) for prompt, fields, params in cases.values()]
    )
    for name, references in zip(cases, all_references, strict=True):
        response = responses[name]
        assert len(response.choices) == len(references), name
        for choice, reference in zip(response.choices, references, strict=True):
            text = choice.message.content if hasattr(choice, "message") else choice.text
            assert (text, choice.finish_reason) == (reference.text, reference.finish_reason), name
            assert choice.model_extra["token_ids"] == reference.token_ids, name
            assert choice.model_extra["stop_reason"] == reference.stop_reason, name
        num_tokens = sum(len(reference.token_ids) for reference in references)
        assert response.usage.completion_tokens == num_tokens, name

    def only_choice(name: str):
        (choice,) = responses[name].choices
        return choice.finish_reason, choice.model_extra["stop_reason"], choice.model_extra

    assert only_choice("stop")[:2] == ("stop", " lemons")
    kept = responses["include_stop_str_in_output"].choices[0]
    assert kept.text == responses["stop"].choices[0].text + " lemons"
    assert (kept.finish_reason, kept.model_extra["stop_reason"]) == ("stop", " lemons")
    assert only_choice("stop_token_ids")[:2] == ("stop", stop_id)
    assert only_choice("stop_token_ids")[2]["token_ids"] == tokens[: stop_position + 1]
    assert only_choice("token ids")[2]["token_ids"] == greedy.token_ids
    assert len(only_choice("max_completion_tokens")[2]["token_ids"]) == 5
    assert len(only_choice("min_tokens")[2]["token_ids"]) >= 6
    assert only_choice("ignore_eos")[:2] == ("length", None)
    city = json.loads(responses["response_format"].choices[0].message.content)
    assert set(city) == {"city", "country"} and only_choice("response_format")[0] == "stop"
    assert responses["structured_outputs choice"].choices[0].text in FRUIT_CHOICES
    assert re.fullmatch(ANSWER_REGEX, responses["guided_regex"].choices[0].message.content)
    assert len({choice.text for choice in responses["n"].choices}) == 2
    assert only_choice("penalties")[2]["token_ids"] != tokens
    assert only_choice("logit_bias")[2]["token_ids"][0] != tokens[0]


def test_logprobs_and_echo(client, llm):
    """echo with logprobs scores the prompt too (the first prompt token has none), as
    lm-evaluation-harness reads it; the values are the offline engine's prompt logprobs."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=3)
    (offline_output,) = llm.generate([FRUITS], params)
    reference = offline_output.outputs[0]
    prompt_ids = offline_output.prompt_token_ids
    response = client.completions.create(
        model=MODEL, prompt=FRUITS, temperature=0, max_tokens=6, logprobs=3, echo=True
    )
    choice = response.choices[0]
    assert choice.text == FRUITS + reference.text
    logprobs = choice.logprobs
    assert response.usage.completion_tokens == 6
    assert len(logprobs.tokens) == len(prompt_ids) + 6
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [entry.logprob for entry in offline_output.prompt_logprobs[1:]]
    expected += [entry.logprob for entry in reference.logprobs]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    generated = zip(logprobs.token_logprobs[-6:], logprobs.top_logprobs[-6:], strict=True)
    for value, tops in generated:
        assert 1 <= len(tops) <= 3
        assert max(tops.values()) == pytest.approx(value, abs=1e-6)  # greedy: the best token
    assert all(len(tops) <= 3 for tops in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[len(prompt_ids)] == len(FRUITS)

    streamed = list(
        client.completions.create(
            model=MODEL, prompt=FRUITS, temperature=0, max_tokens=6, logprobs=3, echo=True,
            stream=True,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens


def test_echo_without_tokens_scores_the_prompt_only(client, llm):
    """echo with max_tokens 0, as lm-evaluation-harness scores a continuation: the answer is
    the prompt with its logprobs (the offline engine's), no token generated (as vLLM)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    (offline_output,) = llm.generate([FRUITS], params)
    prompt_ids = offline_output.prompt_token_ids
    request = {"model": MODEL, "prompt": FRUITS, "max_tokens": 0, "echo": True, "logprobs": 2}
    response = client.completions.create(**request)
    choice = response.choices[0]
    assert choice.text == FRUITS and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == response.usage.total_tokens == len(prompt_ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) and "".join(logprobs.tokens) == FRUITS
    assert logprobs.token_logprobs[0] is None
    expected = [entry.logprob for entry in offline_output.prompt_logprobs[1:]]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)

    streamed = list(client.completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == FRUITS
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens and streamed[-1].choices[0].finish_reason == "length"

    plain = client.completions.create(model=MODEL, prompt=FRUITS, max_tokens=0, echo=True)
    assert plain.choices[0].text == FRUITS and plain.choices[0].logprobs is None
    newer = {"max_completion_tokens": 0}  # the newer name, which wins over max_tokens
    named = client.completions.create(
        model=MODEL, prompt=FRUITS, echo=True, max_tokens=5, extra_body=newer
    )
    assert named.choices[0].text == FRUITS and named.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError):  # without echo, nothing to answer (as vLLM)
        client.completions.create(model=MODEL, prompt=FRUITS, max_tokens=0)


def test_unknown_routes_and_methods_get_openai_errors(worker):
    for method, path, status in [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/completions", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
    ]:
        response = httpx.request(method, worker.url + path, timeout=10)
        assert response.status_code == status, (method, path)
        error = response.json()["error"]
        assert error.keys() == {"message", "type", "param", "code"}
        assert path in error["message"]
        assert error["type"] == {404: "not_found_error", 405: "invalid_request_error"}[status]
        if status == 405:
            assert response.headers["allow"] in error["message"]


def test_forced_tool_calls(client, llm):
    """A named function: its arguments are the output held to its parameters' schema (the
    offline engine's output under that schema); "required": a list of calls; streamed, the
    calls come whole in the last chunk."""
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": parameters}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(
        model=MODEL, messages=weather, tools=tools, tool_choice=named, temperature=0, max_tokens=30
    )
    (reference,) = offline(
        llm, weather, temperature=0, max_tokens=30,
        structured_output=StructuredOutput(json=parameters),
    )  # fmt: skip
    message = answer.choices[0].message
    assert message.content is None and answer.choices[0].finish_reason == "stop"
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == reference.text
    assert set(json.loads(call.function.arguments)) == {"city"} and call.id.startswith("call_")

    required = client.chat.completions.create(
        model=MODEL, messages=weather, tools=tools, tool_choice="required", temperature=0,
        max_tokens=60,
    )  # fmt: skip
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    assert required.choices[0].finish_reason == "tool_calls"

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=weather, tools=tools, tool_choice=named, temperature=0,
            max_tokens=30, stream=True,
        )
    )  # fmt: skip
    streamed = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(streamed) == 1 and streamed[0][0].function.arguments == reference.text
    assert streamed[0][0].index == 0 and chunks[-1].choices[0].finish_reason == "stop"


HERMES_CALL_REGEX = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,10}"\}\}\n</tool_call>'
)


@pytest.mark.slow  # 20 to 45 s; the hermes parser's streaming is unit-tested in
# tests/test_tool_calls.py, and forced calls through the worker run by default
def test_auto_tool_calls(client, llm):
    """tool_choice "auto" (the default with tools; the worker runs the hermes parser): an output
    held by a regex to the hermes format (the offline engine's output under that regex) answers
    with its text before the call as content and the call's arguments, finishing "tool_calls";
    streamed, the content comes first, then the call as the model writes it: its index, id and
    name, then its arguments in pieces that join to the text the model wrote, no tag ever sent.
    An output without calls is plain content."""
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    held = {"structured_outputs": {"regex": HERMES_CALL_REGEX}}
    answer = client.chat.completions.create(
        model=MODEL, messages=weather, tools=WEATHER_TOOLS, temperature=0, max_tokens=60,
        extra_body=held,
    )  # fmt: skip
    (reference,) = offline(
        llm, weather, temperature=0, max_tokens=60,
        structured_output=StructuredOutput(regex=HERMES_CALL_REGEX),
    )  # fmt: skip
    call_json = reference.text.split("<tool_call>\n")[1].split("\n</tool_call>")[0]
    message = answer.choices[0].message
    assert message.content == "Let me check.\n" and answer.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == json.loads(call_json)["arguments"]

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=weather, tools=WEATHER_TOOLS, tool_choice="auto",
            temperature=0, max_tokens=60, extra_body=held, stream=True,
        )
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check.\n"
    assert not any("<tool" in (d.content or "") for d in deltas)
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert not any(d.content for d in deltas[first_call:])
    begun, *pieces = [piece for d in deltas for piece in d.tool_calls or []]
    assert (begun.index, begun.type, begun.function.name) == (0, "function", "get_weather")
    assert begun.id.startswith("call_")
    assert len(pieces) > 2  # the arguments come as they are written
    assert all((p.index, p.id, p.function.name) == (0, None, None) for p in pieces)
    arguments = "".join(piece.function.arguments for piece in [begun, *pieces])
    assert arguments == call_json[call_json.index("{", 1) : -1]  # as the model wrote them
    assert json.loads(arguments) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # Cut short inside the arguments: the call begun stays, its arguments as far as written,
    # and the finish reason says so (not streamed, the cut output is content).
    cut = next(
        length
        for length in range(len(reference.token_ids))
        if '"city": "' in llm.tokenizer.decode(reference.token_ids[:length])
    )
    cut_text = llm.tokenizer.decode(reference.token_ids[:cut])
    cut_chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=weather, tools=WEATHER_TOOLS, temperature=0, max_tokens=cut,
            extra_body=held, stream=True,
        )
    )  # fmt: skip
    cut_pieces = [p for c in cut_chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert cut_pieces[0].function.name == "get_weather"
    cut_arguments = "".join(piece.function.arguments for piece in cut_pieces)
    assert cut_text.endswith(cut_arguments) and cut_arguments.startswith('{"city": "')
    assert cut_chunks[-1].choices[0].finish_reason == "length"

    plain = client.chat.completions.create(
        model=MODEL, messages=YES_OR_NO, tools=WEATHER_TOOLS, temperature=0, max_tokens=8
    )
    (plain_reference,) = offline(llm, YES_OR_NO, temperature=0, max_tokens=8)
    assert plain.choices[0].message.content == plain_reference.text
    assert not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == plain_reference.finish_reason


@pytest.mark.slow  # a worker of its own; the parser itself: tests/test_tool_calls.py
def test_mistral_tool_call_parser_keeps_special_tokens(tmp_path, llm):
    """The mistral parser's markers are special tokens, so with it tool_choice "auto" keeps
    special tokens in the text (as vLLM does): the answer is the offline engine's text with
    skip_special_tokens off, an end-of-turn token in it (ignore_eos writes on past it); with
    tool_choice "none" they are skipped as usual."""
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "mistral")
    params = dict(temperature=0, max_tokens=16, ignore_eos=True)
    (kept,) = offline(llm, FRANCE, skip_special_tokens=False, **params)
    (skipped,) = offline(llm, FRANCE, **params)
    assert kept.text != skipped.text  # a special token to keep
    with running_worker(tmp_path, *flags) as worker:
        client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
        for tool_choice, expected in (("auto", kept.text), ("none", skipped.text)):
            answer = client.chat.completions.create(
                model=MODEL, messages=FRANCE, tools=WEATHER_TOOLS, tool_choice=tool_choice,
                temperature=0, max_tokens=16, extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert answer.choices[0].message.content == expected
            assert not answer.choices[0].message.tool_calls


def test_api_key_from_the_environment_chat_templates_and_model_names(tmp_path, llm, monkeypatch):
    """A worker with TANDEM_API_KEY in its environment, a --chat-template file,
    --trust-request-chat-template and two --served-model-name names. Every endpoint but
    /health, /version and /metrics wants the key: without it or with a wrong one, OpenAI's 401.
    Messages are rendered with the file's template, or with a request's own: /tokenize gives
    the tokenizer's tokens of the text each template makes (written here by hand), and the chat
    answer (asked by the second name, answered by the first) is the offline engine's greedy
    completion of those tokens."""
    template_file = tmp_path / "template.jinja"
    template_file.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    own_template = "<<{{ messages[-1].content }}>> Answer:"
    rendered = {
        None: "[user] What is the capital of France?\n[assistant] ",
        own_template: "<<What is the capital of France?>> Answer:",
    }
    monkeypatch.setenv("TANDEM_API_KEY", "sesame")
    flags = ("--chat-template", str(template_file), "--trust-request-chat-template")
    flags += ("--served-model-name", "smollm2", "assistant")
    with running_worker(tmp_path, *flags) as worker:
        for path in ("/v1/models", "/tokenize"):
            for headers in ({}, {"Authorization": "Bearer open-sesame"}):
                refused = httpx.post(worker.url + path, json={"prompt": "hi"}, headers=headers)
                if path == "/v1/models":
                    refused = httpx.get(worker.url + path, headers=headers)
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/version", "/metrics"):
            assert httpx.get(worker.url + path).status_code == 200

        client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="sesame", max_retries=0)
        assert [model.id for model in client.models.list()] == ["smollm2", "assistant"]
        with pytest.raises(openai.NotFoundError, match="'smollm2' or 'assistant'"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        for template, text in rendered.items():
            expected = llm.tokenizer(text, add_special_tokens=False).input_ids
            extra = {} if template is None else {"chat_template": template}
            tokenized = httpx.post(
                worker.url + "/tokenize",
                json={"messages": FRANCE, **extra},
                headers={"Authorization": "Bearer sesame"},
            )
            assert tokenized.json()["tokens"] == expected
            answer = client.chat.completions.create(
                model="assistant", messages=FRANCE, temperature=0, max_tokens=6, extra_body=extra
            )
            assert answer.model == "smollm2" and answer.usage.prompt_tokens == len(expected)
            (reference,) = offline(llm, expected, temperature=0, max_tokens=6)
            assert answer.choices[0].message.content == reference.text


def test_a_worker_answers_browsers_of_its_allowed_origins():
    """--allowed-origins on a worker (the app over a stand-in engine client): a preflight from
    an allowed origin is answered, before the API key is asked for; another origin's is not."""
    settings = ServerSettings(
        served_model_name=MODEL, api_key="sesame", allowed_origins=("https://ui.example",)
    )
    app = TestClient(build_app(SimpleNamespace(), settings))
    preflight = {"access-control-request-method": "POST"}
    allowed = app.options("/v1/completions", headers={"origin": "https://ui.example", **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
    other = app.options("/v1/completions", headers={"origin": "https://x.example", **preflight})
    assert other.status_code == 400
    assert app.post("/v1/completions", json={"prompt": "hi"}).status_code == 401


def test_a_model_without_a_chat_template_is_told_what_to_do(tmp_path):
    """Messages for a model whose tokenizer has no chat template get a 400 that names the flag
    (the app over a stand-in engine client: the check comes before any engine work), and
    --chat-template reads a file, takes a Jinja string as it is, and refuses anything else."""
    stand_in = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))
    app = TestClient(build_app(stand_in, ServerSettings(served_model_name=MODEL)))
    for path in ("/tokenize", "/v1/chat/completions"):
        answer = app.post(path, json={"messages": FRANCE})
        assert answer.status_code == 400
        assert "--chat-template" in answer.json()["error"]["message"]

    template_file = tmp_path / "template.jinja"
    template_file.write_text("{{ messages[0].content }}")
    assert read_chat_template(str(template_file)) == "{{ messages[0].content }}"
    assert read_chat_template("{% for m in messages %}{% endfor %}").startswith("{% for")
    with pytest.raises(SystemExit, match="no file of that name"):
        read_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.slow  # a worker of its own; the parsers themselves: tests/test_reasoning.py
def test_reasoning_parser_splits_reasoning_off_the_content(tmp_path, llm):
    """A worker with --reasoning-parser deepseek_r1, on an output that holds `</think>`: the
    offline engine's text, split at the tag by hand, as the message's reasoning (also as
    `reasoning_content`) and content; streamed, the reasoning deltas come first and join to
    the same, no part of the tag sent. A structured output is not split (held from its first
    token, it has no reasoning)."""
    messages = [{"role": "user", "content": "Echo back: <think>x</think>y"}]
    (reference,) = offline(llm, messages, temperature=0, max_tokens=30)
    reasoning, tag, content = reference.text.partition("</think>")
    assert tag and reasoning and content  # the greedy output holds the end tag
    with running_worker(tmp_path, "--reasoning-parser", "deepseek_r1") as worker:
        client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
        request = dict(model=MODEL, messages=messages, temperature=0, max_tokens=30)
        message = client.chat.completions.create(**request).choices[0].message
        assert message.content == content
        assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
        assert message.model_extra["reasoning"] == reasoning

        deltas = [
            chunk.choices[0].delta.model_dump()
            for chunk in client.chat.completions.create(**request, stream=True)
            if chunk.choices
        ]
        fields = [(name, d.get(name)) for d in deltas for name in ("reasoning", "content")]
        fields = [(name, text) for name, text in fields if text]
        assert "".join(text for name, text in fields if name == "reasoning") == reasoning
        assert "".join(text for name, text in fields if name == "content") == content
        names = [name for name, _ in fields]
        assert names == sorted(names, reverse=True)  # every reasoning piece before the content
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
        assert not any("</" in text for _, text in fields)

        held = {"structured_outputs": {"regex": "Paris</think>x"}}
        message = client.chat.completions.create(**request, extra_body=held).choices[0].message
        assert message.content == "Paris</think>x" and "reasoning" not in message.model_extra


def test_vllm_prompt_logprobs(client, llm):
    (offline_output,) = llm.generate(
        [FRUITS], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    )
    answer = client.completions.create(
        model=MODEL, prompt=FRUITS, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    listed = answer.choices[0].model_extra["prompt_logprobs"]
    prompt_ids = offline_output.prompt_token_ids
    assert len(listed) == len(prompt_ids) and listed[0] is None
    for token_id, entry, expected in zip(
        prompt_ids[1:], listed[1:], offline_output.prompt_logprobs[1:], strict=True
    ):
        assert entry[str(token_id)]["logprob"] == pytest.approx(expected.logprob, abs=1e-4)
        assert entry[str(token_id)]["rank"] == expected.rank >= 1
        tops = sorted((v["rank"], k) for k, v in entry.items() if v["rank"] <= 2)
        assert [int(k) for _, k in tops][:2] == [t for t, _ in expected.top]
    chat = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    listed = chat.model_extra["prompt_logprobs"]
    assert listed[0] is None and all(len(entry) == 1 for entry in listed[1:])
    assert len(listed) == chat.usage.prompt_tokens

    chat = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) for entry in content)


# -- concurrency ---------------------------------------------------------------------------------


@pytest.mark.slow  # 20 s; tests/test_serve_cluster.py runs 64 concurrent streams fast
async def test_64_concurrent_streams_match_the_offline_engine(worker, async_client, llm):
    subjects = ["a lighthouse", "the moon", "a small robot", "an old library", "the river"]
    styles = ["A short poem about", "Three facts about", "A story that begins with", "Why I like"]
    prompts = [f"{styles[i % 4]} {subjects[i % 5]} (part {i}):" for i in range(64)]
    params = [
        {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i}
        for i in range(64)
    ]

    async def stream(prompt: str, fields: dict[str, Any]) -> tuple[str, list[int], Any, Any]:
        chunks = await async_client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
            **fields,
        )
        text, token_ids, finish_reason, usage = "", [], None, None
        async for chunk in chunks:
            for choice in chunk.choices:
                text += choice.text
                token_ids += choice.model_extra.get("token_ids", [])
                finish_reason = choice.finish_reason or finish_reason
            usage = chunk.usage or usage
        return text, token_ids, finish_reason, usage

    results = await asyncio.gather(*(stream(p, f) for p, f in zip(prompts, params, strict=True)))
    references = llm.generate(prompts, [SamplingParams(max_tokens=16, **f) for f in params])
    for prompt, (text, token_ids, finish_reason, usage), reference in zip(
        prompts, results, references, strict=True
    ):
        expected = reference.outputs[0]
        assert (text, token_ids, finish_reason) == (
            expected.text,
            expected.token_ids,
            expected.finish_reason,
        ), prompt
        assert usage.completion_tokens == len(expected.token_ids)
        assert usage.prompt_tokens == len(reference.prompt_token_ids)
    assert wait_for_metric(worker.url, BLOCKS_USED, 0.0) == 0.0
    assert read_metrics(worker.url)["tandem_requests_running"] == 0


# -- metrics ---------------------------------------------------------------------------------------


def test_metrics_count_one_streamed_request_exactly(worker, client):
    before = read_metrics(worker.url)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=FRUITS,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = chunks[-1].usage
    after = read_metrics(worker.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("tandem_prompt_tokens_total") == usage.prompt_tokens
    assert delta("tandem_generation_tokens_total") == usage.completion_tokens == 6
    assert delta("tandem_time_to_first_token_seconds_count") == 1
    assert delta("tandem_inter_token_latency_seconds_count") == 5
    assert delta("tandem_e2e_request_latency_seconds_count") == 1
    labels = f'model_name="{MODEL}"'
    assert delta(f'tandem_requests_total{{finish_reason="length",{labels}}}') == 1
    assert delta(f'tandem_requests_total{{finish_reason="abort",{labels}}}') == 0
    # vLLM's names for the same counts, and its KV cache usage from the block gauges
    assert delta("vllm:prompt_tokens_total") == usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta(f'vllm:request_success_total{{finished_reason="length",{labels}}}') == 1
    for name in ("requests_running", "requests_waiting"):
        assert after[f"vllm:num_{name}"] == after[f"tandem_{name}"]
    used, total = after["tandem_kv_cache_blocks_used"], after["tandem_kv_cache_blocks_total"]
    assert after["vllm:kv_cache_usage_perc"] == used / total
    # the load report a router reads has the TPOT p90 in integer ms (0 until ten responses are
    # recent: the unit tests below)
    load = httpx.get(f"{worker.url}/health", timeout=10).json()["load"]
    assert isinstance(load["tpot_p90_ms"], int)
    # and what decoding costs the engine (0 until 32 decode steps)
    for key in (
        "decode_step_base_us",
        "decode_step_us_per_ktoken",
        "decode_context_tokens",
        "decode_token_interval_us",
    ):
        assert isinstance(load[key], int) and load[key] >= 0


def test_load_report_latency_is_the_p90_of_the_last_responses_tpot():
    metrics = WorkerMetrics("m")
    assert metrics.load_report(now=100.0)["tpot_p90_ms"] == 0  # no response yet
    metrics.observe_tpot(now=75.0, seconds=0.9)  # older than the window at 100 s: left out
    for milliseconds in (8, 2, 10, 4, 6, 1, 3, 5, 7):
        metrics.observe_tpot(now=95.0, seconds=milliseconds / 1000)
    assert metrics.load_report(now=100.0)["tpot_p90_ms"] == 0  # 9 responses: too few
    metrics.observe_tpot(now=95.0, seconds=0.009)
    metrics.load = {"tokens_waiting": 12}
    metrics.last_request_end = 90.0
    # nearest rank: the 9th of the ten in order
    assert metrics.load_report(now=100.0) == {
        "tokens_waiting": 12,
        "idle_ms": 10000,
        "tpot_p90_ms": 9,
    }
    metrics.observe_tpot(now=96.0, seconds=0.011)
    assert metrics.load_report(now=100.0)["tpot_p90_ms"] == 10  # the 10th of eleven
    assert metrics.load_report(now=106.5)["tpot_p90_ms"] == 0  # all of them older than 10 s


def test_load_report_idle_time_is_zero_while_a_request_is_in_flight():
    """idle_ms: how long since the last response ended (the worker's start before any), 0
    while any response is in flight, whatever the engine's stats last said."""
    metrics = WorkerMetrics("m")
    metrics.last_request_end = 50.0
    assert metrics.load_report(now=52.5)["idle_ms"] == 2500
    first, second = LatencyTracker(metrics, "m", 0.0, 1), LatencyTracker(metrics, "m", 0.0, 3)
    assert metrics.load_report(now=60.0)["idle_ms"] == 0
    first.finish([])
    assert metrics.load_report(now=60.0)["idle_ms"] == 0  # the second is still in flight
    second.finish([])
    ended = metrics.last_request_end  # time.monotonic() at its end
    assert metrics.requests_in_flight == 0 and ended != 50.0
    assert metrics.load_report(now=ended + 1.25)["idle_ms"] == 1250


def test_load_report_latency_counts_the_streams_running_now():
    """A one-choice response streaming now counts with its TPOT so far once it has 16 tokens,
    and leaves the live set when it ends (its final TPOT then counts as an ended response's)."""
    metrics = WorkerMetrics("m")
    for milliseconds in (1, 1, 1, 1, 1, 1, 1, 40):  # ended responses, with the live ones ten
        metrics.observe_tpot(now=95.0, seconds=milliseconds / 1000)
    slow, fast, many = (LatencyTracker(metrics, "m", 0.0, n) for n in (1, 1, 2))
    assert metrics.live_streams == {slow, fast}  # two choices: no one stream's TPOT
    slow.first_token_time, slow.last_token_time, slow.tokens = 10.0, 10.3, 16  # 20 ms a token
    fast.first_token_time, fast.last_token_time, fast.tokens = 10.0, 10.03, 4  # too few yet
    metrics.observe_tpot(now=95.0, seconds=0.005)
    assert metrics.load_report(now=100.0)["tpot_p90_ms"] == 20  # the 9th of ten: 1 x 7, 5, 20, 40
    slow.tokens = 15
    assert metrics.load_report(now=100.0)["tpot_p90_ms"] == 0  # nine: too few
    slow.tokens, fast.tokens = 16, 16  # fast: 2 ms a token
    assert metrics.load_report(now=100.0)["tpot_p90_ms"] == 20  # the 10th of eleven
    slow.finish([])
    assert metrics.live_streams == {fast}
    # the ended stream's 20 ms is now an ended response's (at time.monotonic(), not 100 s)
    assert [round(tpot, 6) for _, tpot in metrics.recent_tpots][-2:] == [0.005, 0.02]
    many.finish([])
    assert len(metrics.recent_tpots) == 10


def test_prefix_cache_hits_show_in_usage_and_metrics(worker, client):
    prompt = list(range(5000, 5048))  # 48 token ids that no other test sends
    block_size = 16
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The engine's stats ride on the same message as a request's last tokens.
    rate_before = read_metrics(worker.url)["tandem_prefix_cache_hit_rate"]
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    # Full blocks only, and the last prompt token is always computed: 2 blocks of 3 hit.
    assert second.usage.prompt_tokens_details.cached_tokens == 2 * block_size
    rate_after = read_metrics(worker.url)["tandem_prefix_cache_hit_rate"]
    assert rate_before < rate_after <= 1


def test_completions_default_to_16_tokens(client):
    """As OpenAI's and vLLM's completions endpoint (chat answers run to the context length)."""
    answer = client.completions.create(model=MODEL, prompt=FRUITS, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"


def test_a_cache_salt_keeps_prefix_cache_hits_within_it(worker, client):
    """vLLM's cache_salt: the same prompt hits the cache only after a request with the same
    salt (or, unsalted, an unsalted one): 2 full blocks of 16 tokens of a 40-token prompt."""
    prompt = list(range(6000, 6040))  # token ids that no other test sends
    cached = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body=salt
        ).usage.prompt_tokens_details.cached_tokens
        for salt in ({"cache_salt": "a"}, {"cache_salt": "a"}, {"cache_salt": "b"}, {}, {})
    ]
    assert cached == [0, 32, 0, 0, 32]
    empty = httpx.post(worker.url + "/v1/completions", json={"prompt": "hi", "cache_salt": ""})
    assert empty.status_code == 400 and "cache_salt" in empty.text


# -- client disconnects ----------------------------------------------------------------------------

LONG_REQUEST = {"prompt": FRUITS, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize(
    "endpoint, body",
    [
        ("/v1/completions", LONG_REQUEST),
        ("/v1/completions", dict(LONG_REQUEST, prompt=[FRUITS, "One, two,"], n=2)),
        ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4000, "ignore_eos": True}),
    ],
    ids=["completion", "two-prompts-n2", "chat"],
)
def test_disconnect_mid_stream_frees_every_block(worker, endpoint, body):
    labels = f'finish_reason="abort",model_name="{MODEL}"'
    aborted_before = read_metrics(worker.url).get(f"tandem_requests_total{{{labels}}}", 0.0)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", worker.url + endpoint, json=dict(body, stream=True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            num_chunks = 0
            while num_chunks < 4:
                num_chunks += next(lines).startswith("data: {")
            assert read_metrics(worker.url)[BLOCKS_USED] > 0
    assert wait_for_metric(worker.url, BLOCKS_USED, 0.0) == 0.0
    metrics = read_metrics(worker.url)
    assert metrics["tandem_requests_running"] == metrics["tandem_requests_waiting"] == 0
    aborted = metrics[f"tandem_requests_total{{{labels}}}"] - aborted_before
    assert aborted == (4 if body.get("n") else 1)
    assert_serving(worker)


def test_client_timeout_on_a_non_streamed_request_frees_every_block(worker):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.url}/v1/completions", json=LONG_REQUEST, timeout=2.0)
    assert wait_for_metric(worker.url, BLOCKS_USED, 0.0) == 0.0
    assert read_metrics(worker.url)["tandem_requests_running"] == 0
    assert_serving(worker)


def test_a_refused_prompt_in_a_batch_leaves_no_request_behind(worker):
    body = dict(LONG_REQUEST, prompt=[FRUITS, "hello " * 9000])  # the second is too long
    response = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and "context length" in response.json()["error"]["message"]
    assert wait_for_metric(worker.url, "tandem_requests_running", 0.0) == 0.0
    assert wait_for_metric(worker.url, BLOCKS_USED, 0.0) == 0.0


# -- bad input -------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
TRUNCATE = "truncate_prompt_tokens"

NO_TEXT_REGEX = r"[^\x00-\U0010FFFF]"  # a character class of no character
BAD_REQUESTS = [
    # (id, endpoint, JSON body or raw bytes, status, expected `param` or None)
    ("malformed-json", COMPLETIONS, b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("malformed-json-chat", CHAT, b'{"messages": [', 400, None),
    ("empty-body", COMPLETIONS, b"", 400, None),
    ("body-not-an-object", COMPLETIONS, [1, 2], 400, None),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    ("max-tokens-string", COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max-tokens-fraction", COMPLETIONS, {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("temperature-string", COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, None),
    ("stream-not-bool", COMPLETIONS, {"prompt": "hi", "stream": "maybe"}, 400, "stream"),
    ("prompt-number", COMPLETIONS, {"prompt": 5}, 400, None),
    ("prompt-mixed-list", COMPLETIONS, {"prompt": [1, "a"]}, 400, None),
    ("stop-number", COMPLETIONS, {"prompt": "hi", "stop": 5}, 400, None),
    ("messages-string", CHAT, {"messages": "hello"}, 400, "messages"),
    ("unknown-role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("negative-max-tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, None),
    (
        "json-schema-invalid",
        CHAT,
        {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
        400,
        None,
    ),
    (
        "json-schema-missing",
        CHAT,
        {"messages": HI, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    (
        "json-schema-unknown-type",
        COMPLETIONS,
        {"prompt": "hi", "structured_outputs": {"json": {"type": "nonsense"}}},
        400,
        None,
    ),
    ("regex-invalid", COMPLETIONS, {"prompt": "hi", "guided_regex": "("}, 400, None),
    (
        "structured-output-twice",
        CHAT,
        {"messages": HI, "response_format": {"type": "json_object"}, "guided_choice": ["a"]},
        400,
        None,
    ),
    ("structured-output-empty", COMPLETIONS, {"prompt": "hi", "structured_outputs": {}}, 400, None),
    ("tool-choice-without-tools", CHAT, {"messages": HI, "tool_choice": "required"}, 400, None),
    ("functions", CHAT, {"messages": HI, "functions": [{"name": "f"}]}, 400, None),
    ("zero-max-tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, None),
    ("negative-max-tokens-chat", CHAT, {"messages": HI, "max_tokens": -3}, 400, None),
    (
        "negative-max-completion-tokens",
        CHAT,
        {"messages": HI, "max_completion_tokens": -1},
        400,
        None,
    ),
    ("negative-temperature", COMPLETIONS, {"prompt": "hi", "temperature": -0.1}, 400, None),
    ("negative-temperature-chat", CHAT, {"messages": HI, "temperature": -1}, 400, None),
    ("top-p-zero", COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, None),
    ("top-p-above-one", COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400, None),
    ("top-p-negative-chat", CHAT, {"messages": HI, "top_p": -0.5}, 400, None),
    ("top-k-negative", COMPLETIONS, {"prompt": "hi", "top_k": -2}, 400, None),
    ("top-k-past-64-bits", COMPLETIONS, {"prompt": "hi", "top_k": 2**70}, 400, None),
    ("seed-past-64-bits", CHAT, {"messages": HI, "seed": 2**64}, 400, None),
    ("seed-below-64-bits", COMPLETIONS, {"prompt": "hi", "seed": -(2**63) - 1}, 400, None),
    ("min-p-above-one", COMPLETIONS, {"prompt": "hi", "min_p": 1.5}, 400, None),
    ("n-zero", COMPLETIONS, {"prompt": "hi", "n": 0}, 400, None),
    ("min-tokens-negative", COMPLETIONS, {"prompt": "hi", "min_tokens": -1}, 400, None),
    (
        "min-over-max-tokens",
        COMPLETIONS,
        {"prompt": "hi", "min_tokens": 5, "max_tokens": 2},
        400,
        None,
    ),
    ("logprobs-too-many", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (
        "top-logprobs-too-many",
        CHAT,
        {"messages": HI, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ("top-logprobs-without-logprobs", CHAT, {"messages": HI, "top_logprobs": 2}, 400, None),
    (
        "template-messages",
        CHAT,
        {"messages": HI, "chat_template_kwargs": {"messages": 1}},
        400,
        "chat_template_kwargs",
    ),
    (
        "stream-options-unstreamed",
        COMPLETIONS,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        None,
    ),
    # JSON without NaN and Infinity, which Python's parser takes
    ("infinite-temperature", COMPLETIONS, b'{"prompt": "hi", "temperature": Infinity}', 400, None),
    ("inf-penalty", COMPLETIONS, b'{"prompt": "hi", "repetition_penalty": Infinity}', 400, None),
    ("empty-stop-string", COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, None),
    ("suffix", COMPLETIONS, {"prompt": "def f(", "suffix": "return x"}, 400, "suffix"),
    ("best-of", COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("truncate", COMPLETIONS, {"prompt": "hi", "truncate_prompt_tokens": 1}, 400, TRUNCATE),
    ("truncate-chat", CHAT, {"messages": HI, "truncate_prompt_tokens": -1}, 400, TRUNCATE),
    ("presence-penalty-too-big", COMPLETIONS, {"prompt": "hi", "presence_penalty": 2.5}, 400, None),
    ("frequency-penalty-too-small", CHAT, {"messages": HI, "frequency_penalty": -3}, 400, None),
    ("repetition-penalty-zero", COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, 400, None),
    ("logit-bias-word", COMPLETIONS, {"prompt": "hi", "logit_bias": {"apple": 1}}, 400, None),
    ("logit-bias-too-big", CHAT, {"messages": HI, "logit_bias": {"5": 150}}, 400, None),
    (
        "logit-bias-outside-vocabulary",
        COMPLETIONS,
        {"prompt": "hi", "logit_bias": {"99999999": 1}},
        400,
        None,
    ),
    ("max-tokens-over-context", COMPLETIONS, {"prompt": "hi", "max_tokens": 8192}, 400, None),
    ("max-tokens-huge", COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}, 400, None),
    ("max-tokens-over-context-chat", CHAT, {"messages": HI, "max_tokens": 9000}, 400, None),
    ("prompt-fills-context", COMPLETIONS, {"prompt": [1] * 8192}, 400, None),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("empty-prompt-list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("empty-token-list-in-batch", COMPLETIONS, {"prompt": [[]]}, 400, "prompt"),
    ("empty-string-in-batch", COMPLETIONS, {"prompt": ["hi", ""]}, 400, "prompt"),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("token-id-outside-vocab", COMPLETIONS, {"prompt": [1, 49152]}, 400, "prompt"),
    ("negative-token-id", COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
    ("n-over-the-queue", COMPLETIONS, {"prompt": "hi", "n": 5000, "max_tokens": 1}, 400, None),
    (
        "template-kwargs-clash",
        CHAT,
        {"messages": HI, "chat_template_kwargs": {"tokenize": 1}},
        400,
        None,
    ),
    (
        "request-chat-template-untrusted",
        CHAT,
        {"messages": HI, "chat_template": "{{ messages[0].content }}"},
        400,
        "chat_template",
    ),
    (
        "template-kwargs-chat-template-untrusted",
        CHAT,
        {"messages": HI, "chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}},
        400,
        "chat_template",
    ),
    ("priority-without-policy", COMPLETIONS, {"prompt": "hi", "priority": 1}, 400, "priority"),
    ("lone-surrogate", COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    (
        "lone-surrogate-chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
        400,
        "messages",
    ),
    (
        "image-part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages.0.content",
    ),
    (
        "pd-without-transport",
        COMPLETIONS,
        {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}},
        400,
        "kv_transfer_params",
    ),
    (  # a regex no text matches: refused by the engine as it admits it, before any token
        "regex-matching-nothing",
        COMPLETIONS,
        {"prompt": "hi", "structured_outputs": {"regex": NO_TEXT_REGEX}},
        400,
        None,
    ),
    (
        "grammar-matching-nothing-streamed",
        CHAT,
        {"messages": HI, "stream": True, "guided_grammar": f"start: A\nA: /{NO_TEXT_REGEX}/"},
        400,
        None,
    ),
    ("unknown-model", COMPLETIONS, {"prompt": "hi", "model": "gpt-5"}, 404, "model"),
    ("unknown-model-chat", CHAT, {"messages": HI, "model": "gpt-5"}, 404, "model"),
]


@pytest.mark.parametrize(
    "endpoint, body, status, param",
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_input_gets_a_4xx_error_object(worker, endpoint, body, status, param):
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        response = httpx.post(worker.url + endpoint, content=body, headers=headers, timeout=30)
    else:
        response = httpx.post(worker.url + endpoint, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert error["code"] == status
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    if param is not None:
        assert error["param"] == param


def test_a_constraint_matching_nothing_says_so_and_the_worker_keeps_serving(worker, client):
    """It was answered 200 with empty text (the grammar left only the end of text)."""
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(
            model=MODEL, prompt="hi", extra_body={"structured_outputs": {"regex": NO_TEXT_REGEX}}
        )
    assert "the regex for structured outputs matches no text this model can write" in (
        bad.value.message
    )
    assert_serving(worker)


def test_openai_client_raises_on_4xx_and_the_server_keeps_serving(worker, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert "max_tokens" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HI)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HI, temperature=-1, stream=True)
    assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200
    assert_serving(worker)
