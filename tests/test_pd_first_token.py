"""The first token of a PD stream spliced by token: the client gets the prefill's first token
(its text less the stop-string hold-back, tandem.pd.text; a chat's split as the prefill answer
split it, router/chunks.py) and then a decode stream told `first_token_sent`, whose writer parses
the whole output but streams only what the first chunk left out. The reference is one worker's
stream of the same tokens, through the same writers.

Completions: the texts hold CJK and emoji, whose characters the default model's byte-level
tokenizer splits over several tokens (so a first token may be an incomplete UTF-8 sequence), and
stop strings that straddle the first token and the next. Chat: reasoning parsers and a tool call
parser on a tokenizer with the tags as tokens of their own.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerFast

from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.processor import OutputProcessor, SequenceDelta
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.pd.text import shown_first_text, stop_hold_back
from tandem.router.chunks import DecodeChunks, first_chunk
from tandem.router.classify import choice_text
from tandem.server.metrics import WorkerMetrics
from tandem.server.openai.chat import ChatWriter
from tandem.server.openai.chat_request import ChatCompletionRequest
from tandem.server.openai.completion_request import CompletionRequest
from tandem.server.openai.completions import CompletionWriter
from tandem.server.settings import ServerSettings
from tiny_models import byte_level_bpe

TEXTS = ["日本語のテキスト。", "🦙🚀 done", "Hello, world! The end.", "한국어 텍스트"]
SENT = {"first_token_sent": True}


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.models.gguf_loader import load_gguf_tokenizer, resolve_default_model

    return load_gguf_tokenizer(resolve_default_model())


def deltas(tokenizer, prompt, token_ids, params, max_tokens=None) -> list[SequenceDelta]:
    """The deltas a worker's engine gives for `token_ids`, one token per step."""
    processor = OutputProcessor(tokenizer)
    request = Request("r", prompt, params, eos_token_ids=frozenset({tokenizer.eos_token_id}))
    processor.add("r", request, 0)
    out = []
    for index, token_id in enumerate(token_ids[:max_tokens]):
        finish = "length" if index == len(token_ids[:max_tokens]) - 1 else None
        (delta,), _ = processor.process([EngineCoreOutput("r", [token_id], finish_reason=finish)])
        out.append(delta)
        if delta.finish_reason is not None:
            break
    return out


def written(writer, stream: list[SequenceDelta], streamed: bool = True):
    """The writer's chunks for the deltas (streamed), or its whole answer."""

    async def source():
        for delta in stream:
            yield 0, delta

    async def run():
        metrics = WorkerMetrics("m")
        if not streamed:
            return await writer.collect(source(), metrics, time.monotonic())
        return [chunk async for chunk in writer.stream(source(), metrics, time.monotonic())]

    return asyncio.run(run())


def completion_cases(tokenizer):
    for text in TEXTS:
        token_ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        first_text = tokenizer.decode(token_ids[:1])
        yield token_ids, None
        # a stop string that the first token begins and the next one completes
        first_chars = first_text.rstrip("\ufffd")
        second = tokenizer.decode(token_ids[:2])
        if first_chars and len(second) > len(first_chars):
            straddling = first_chars[-1] + second[len(first_chars)]
            yield token_ids, [straddling + "\x00"]  # held back, never matched
            yield token_ids, [straddling]


def completion_writer(tokenizer, prompt: list[int], stop, **fields) -> CompletionWriter:
    body = CompletionRequest(prompt=prompt, stream=True, stop=stop, **fields)
    client = SimpleNamespace(tokenizer=tokenizer)
    return CompletionWriter(client, ServerSettings("m"), body, "c", [prompt], [prompt])


def test_the_client_completion_stream_equals_one_workers_stream(tokenizer):
    checked_incomplete = checked_straddling = 0
    prompt = list(tokenizer("Reply with the text:").input_ids)
    for token_ids, stop in completion_cases(tokenizer):
        params = SamplingParams(stop=stop or [])
        whole = deltas(tokenizer, prompt, token_ids, params)
        writer = functools.partial(completion_writer, tokenizer, prompt, stop)
        reference = written(writer(), whole)
        (prefill,) = deltas(tokenizer, prompt, token_ids, params, max_tokens=1)
        shown = shown_first_text(prefill.text, stop_hold_back(stop, False))
        decode = written(writer(kv_transfer_params=SENT, return_token_ids=True), whole)
        texts = [choice["text"] for chunk in decode for choice in chunk["choices"]]
        assert shown + "".join(texts) == "".join(
            choice["text"] for chunk in reference for choice in chunk["choices"]
        ), stop
        # the decode stream carries the request's token ids after the first (the client has it)
        ids = [i for chunk in decode for choice in chunk["choices"] for i in choice["token_ids"]]
        assert ids == [i for delta in whole for i in delta.token_ids][1:]
        checked_incomplete += "\ufffd" in tokenizer.decode(token_ids[:1])
        checked_straddling += bool(stop) and stop[0][-1] != "\x00"
    assert checked_incomplete and checked_straddling


@pytest.fixture(scope="module")
def tagged_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with the reasoning and hermes tool call tags as tokens
    of their own (added, not special: they stay in the text, as in Qwen3's)."""
    core = byte_level_bpe(['Paris London pick a city "name" "arguments" {}'] * 10, 300)
    core.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")


CALL = '<tool_call>{"name": "pick", "arguments": {"city": "Paris"}}</tool_call>'
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}}}
CHAT_CASES = [
    ("qwen3", None, "<think>pick a</think>Paris London"),
    ("qwen3", None, "Paris London pick"),  # thinking off: all content
    ("qwen3", None, "<think>pick a city"),  # cut short in the reasoning
    ("deepseek_r1", None, "</think>Paris London"),  # the prompt opened the reasoning
    ("deepseek_r1", None, "pick a city</think>Paris"),
    ("deepseek_r1", None, "<think>pick</think>Paris"),
    ("qwen3", "hermes", "<think>pick</think>Paris " + CALL),
    (None, "hermes", "Paris " + CALL + " London"),
]


def assembled(chunks: list[dict]) -> tuple[str, str, list[tuple[str, str]], list[int]]:
    """A chat stream's reasoning, content, tool calls (name, arguments) and token ids."""
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    ids: list[int] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content"), delta
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, arguments = calls.setdefault(call["index"], ["", ""])
                function = call.get("function") or {}
                calls[call["index"]] = [
                    name + (function.get("name") or ""),
                    arguments + (function.get("arguments") or ""),
                ]
            ids += choice.get("token_ids") or []
    return reasoning, content, [tuple(call) for _, call in sorted(calls.items())], ids


@pytest.mark.parametrize("stop", [None, ["\x00zz"]], ids=["no stop", "held back"])
@pytest.mark.parametrize(("reasoning", "tools", "text"), CHAT_CASES)
def test_the_routers_chat_stream_equals_one_workers_stream(
    tagged_tokenizer, reasoning, tools, text, stop
):
    """The router's first chunk (from the prefill worker's answer) and the decode worker's
    stream rewritten by the router assemble to one worker's stream: reasoning, content, tool
    calls and token ids."""
    tokenizer = tagged_tokenizer
    prompt = list(tokenizer("pick a city\n").input_ids)
    token_ids = list(tokenizer(text).input_ids)
    assert len(token_ids) >= 2
    settings = ServerSettings("m", reasoning_parser=reasoning, tool_call_parser=tools)
    client = SimpleNamespace(tokenizer=tokenizer)
    params = SamplingParams(stop=stop or [])

    def writer(**fields):
        body = ChatCompletionRequest(
            messages=[{"role": "user", "content": "pick a city"}],
            stop=stop,
            return_token_ids=True,
            tools=[TOOL] if tools else None,
            **fields,
        )
        return ChatWriter(client, settings, body, "c", [prompt])

    whole = deltas(tokenizer, prompt, token_ids, params)
    reference = assembled(written(writer(stream=True), whole))
    assert reference[0] or reference[1] or reference[2]

    prefill = written(
        writer(kv_transfer_params={"do_remote_decode": True}),
        deltas(tokenizer, prompt, token_ids, params, max_tokens=1),
        streamed=False,
    )
    shown = shown_first_text(
        choice_text("chat", prefill["choices"][0], streamed=False), stop_hold_back(stop, False)
    )
    first = json.loads(first_chunk("chat", "c", prefill, shown).removeprefix(b"data: "))
    rewrite = DecodeChunks("chat", "c").rewrite
    decode = written(writer(stream=True, kv_transfer_params=SENT), whole)
    rest = [chunk for chunk in map(rewrite, decode) if chunk is not None]
    assert assembled([first, *rest]) == reference
