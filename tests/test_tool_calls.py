"""Tool calls found in free text (tool_choice "auto"): each parser's calls and content, checked
against calls written out by hand, and the streaming contract: the text `content_end` lets go
of while an output grows is always the start of the content the whole output has."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.server.tool_calls import ParsedOutput, calls_so_far, content_end, parse_tool_calls

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "note": "a;b </x>"}}
TIME = {"name": "get_time", "arguments": {}}


def arguments(call: dict) -> str:
    return json.dumps(call["arguments"], ensure_ascii=False)


HERMES_CASES = [
    (  # content, then two calls, each in its pair of tags
        f"Let me look.\n<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>\n"
        f"<tool_call>{json.dumps(TIME)}</tool_call>",
        ParsedOutput("Let me look.\n", [("get_weather", arguments(WEATHER)), ("get_time", "{}")]),
    ),
    (  # a list of calls in one pair (SmolLM2), non-ASCII kept
        '<tool_call>[{"name": "f", "arguments": {"x": "é"}}, {"name": "g", "arguments": {}}]'
        "</tool_call>",
        ParsedOutput(None, [("f", '{"x": "é"}'), ("g", "{}")]),
    ),
    (  # the output ended before the closing tag
        f"<tool_call>\n{json.dumps(WEATHER)}\n",
        ParsedOutput(None, [("get_weather", arguments(WEATHER))]),
    ),
    (  # arguments already a string, "parameters" instead of "arguments"
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name": "g", "parameters": {"b": 2}}</tool_call>',
        ParsedOutput(None, [("f", '{"a": 1}'), ("g", '{"b": 2}')]),
    ),
]
HERMES_NOT_CALLS = [
    "No tools needed: 4.",
    '<tool_call>{"name": "f", "argu',  # cut short by max_tokens
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f"}</tool_call><tool_call>oops</tool_call>',  # one bad call: none
    "<tool_call>[1, 2]</tool_call>",
]

LLAMA_CASES = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris", "note": "a;b"}}',
        ParsedOutput(None, [("get_weather", '{"city": "Paris", "note": "a;b"}')]),
    ),
    (
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}};',
        ParsedOutput(None, [("f", "{}"), ("g", '{"x": 1}')]),
    ),
    ('  \n{"name": "f", "parameters": {}}\n', ParsedOutput(None, [("f", "{}")])),
]
LLAMA_NOT_CALLS = [
    "The weather is fine.",
    'Call {"name": "f", "parameters": {}}',  # text first: an answer that shows JSON
    '{"name": "f", "parameters": {}} {"name": "g", "parameters": {}}',  # no ";" between
    '{"city": "Paris"}',  # JSON, not a call
    '{"name": "f", "parameters": {',  # cut short
]

MISTRAL_CASES = [
    (  # before v11: one JSON list after the token, a space between (as the tokenizer decodes)
        f"[TOOL_CALLS] [{json.dumps(WEATHER)}, {json.dumps(TIME)}]",
        ParsedOutput(None, [("get_weather", arguments(WEATHER)), ("get_time", "{}")]),
    ),
    (  # content first, one object rather than a list, the other marker's text in a value
        'Checking.[TOOL_CALLS]{"name": "f", "arguments": {"x": "é [ARGS]"}}',
        ParsedOutput("Checking.", [("f", '{"x": "é [ARGS]"}')]),
    ),
    (  # v11: name[ARGS]{...} after each token
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        ParsedOutput("Sure.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ),
]
MISTRAL_NOT_CALLS = [
    "The weather is fine.",
    '[TOOL_CALLS] [{"name": "f", "argu',  # cut short
    "[TOOL_CALLS]get weather[ARGS]{}",  # not a function name
    "[TOOL_CALLS]f[ARGS][1, 2]",  # arguments not an object
    '[TOOL_CALLS][{"name": "f", "arguments": {}}][TOOL_CALLS]oops',  # one bad call: none
]

PYTHONIC_CASES = [
    (  # literals of every kind, a call without arguments
        '[get_weather(city="Paris", days=3, hot=True, unit=None, ids=[1, {"a": 2.5}]), get_time()]',
        ParsedOutput(
            None,
            [
                (
                    "get_weather",
                    '{"city": "Paris", "days": 3, "hot": true, "unit": null, '
                    '"ids": [1, {"a": 2.5}]}',
                ),
                ("get_time", "{}"),
            ],
        ),
    ),
    (  # Llama 4's tags around the list, non-ASCII kept, a tuple as a list
        '<|python_start|>[f(x="é", pair=(1, 2))]<|python_end|>\n',
        ParsedOutput(None, [("f", '{"x": "é", "pair": [1, 2]}')]),
    ),
]
PYTHONIC_NOT_CALLS = [
    "The weather is fine.",
    "Call [f()] for that",  # text first
    "[f(1)]",  # a positional argument
    "[f(a=b)]",  # a name, not a literal
    "[f(**options)]",
    "[tools.f(a=1)]",  # not a plain name
    "[f(a={1, 2})]",  # a set: no JSON for it
    "[f(a=1e999)]",  # infinity: no JSON for it either
    "[]",
    "[f(a=1), 3]",  # one element not a call: none
    '[f(a="x"',  # cut short
]


CALLS = [("hermes", *case) for case in HERMES_CASES]
CALLS += [("llama3_json", *case) for case in LLAMA_CASES]
CALLS += [("mistral", *case) for case in MISTRAL_CASES]
CALLS += [("pythonic", *case) for case in PYTHONIC_CASES]
NOT_CALLS = [("hermes", text) for text in HERMES_NOT_CALLS]
NOT_CALLS += [("llama3_json", text) for text in LLAMA_NOT_CALLS]
NOT_CALLS += [("mistral", text) for text in MISTRAL_NOT_CALLS]
NOT_CALLS += [("pythonic", text) for text in PYTHONIC_NOT_CALLS]


@pytest.mark.parametrize(("parser", "text", "expected"), CALLS)
def test_calls_are_found(parser, text, expected):
    assert parse_tool_calls(parser, text) == expected


@pytest.mark.parametrize(("parser", "text"), NOT_CALLS)
def test_text_without_valid_calls_is_content(parser, text):
    assert parse_tool_calls(parser, text) == ParsedOutput(text, [])


STREAMED = [(parser, text) for parser, text, _ in CALLS] + NOT_CALLS
STREAMED += [("hermes", "a < b, <tool but no call"), ("llama3_json", "<b>bold</b>")]
STREAMED += [("pythonic", "<|python_tag|> is not the start tag"), ("mistral", "[TOOL] [1]")]


@pytest.mark.parametrize(("parser", "text"), STREAMED)
def test_streamed_content_is_never_taken_back(parser, text):
    """At every length of the growing output, the text let go of so far starts the content of
    the whole output (no call's text goes out as content first)."""
    content = parse_tool_calls(parser, text).content or ""
    released = 0
    for length in range(len(text) + 1):
        released = max(released, content_end(parser, text[:length]))
        assert content.startswith(text[:released]), (length, text[:released])


# How many calls of each CALLS case are streamed (written as objects, name first,
# alone or in a list): all but hermes' string arguments (and the call after it) and pythonic's.
STREAMED_CALLS = [2, 2, 1, 0] + [1, 2, 1] + [2, 1, 2] + [0, 0]


@pytest.mark.parametrize(
    ("parser", "text", "expected", "num_streamed"),
    [(*case, count) for case, count in zip(CALLS, STREAMED_CALLS, strict=True)],
)
def test_streamed_calls_grow_into_the_calls_found(parser, text, expected, num_streamed):
    """At every length of the growing output, the calls begun so far keep those begun before
    (names, and arguments that only grow); at the end they are the first calls found in the
    whole output, each complete, its arguments the same JSON."""
    begun: list = []
    for length in range(len(text) + 1):
        calls = calls_so_far(parser, text[:length])
        assert len(calls) >= len(begun), length
        for before, now in zip(begun, calls[: len(begun)], strict=True):
            assert now.name == before.name and now.arguments.startswith(before.arguments)
        begun = calls
    assert len(begun) == num_streamed
    for call, (name, found_arguments) in zip(begun, expected.calls[:num_streamed], strict=True):
        assert call.complete and call.name == name
        assert json.loads(call.arguments) == json.loads(found_arguments)


PLAIN = [
    ("hermes", "No tools needed: 4."),
    ("hermes", "a < b, <tool but no call"),
    ("llama3_json", "The weather is fine."),
    ("llama3_json", 'Call {"name": "f", "parameters": {}}'),
    ("llama3_json", "<b>bold</b>"),
    ("mistral", "The weather is fine."),
    ("mistral", "A list: [1, 2]"),
    ("pythonic", "The weather is fine."),
    ("pythonic", "Call [f()] for that"),
    ("pythonic", "<|python_tag|> is not the start tag"),
]


@pytest.mark.parametrize(("parser", "text"), PLAIN)
def test_plain_text_is_let_go_of_as_it_comes(parser, text):
    assert content_end(parser, text) == len(text)


def test_hermes_and_mistral_hold_only_what_may_begin_their_marker():
    assert content_end("hermes", "Sure <tool") == len("Sure ")
    assert content_end("hermes", "Sure <b") == len("Sure <b")
    assert content_end("hermes", "Sure <tool_call>{") == len("Sure ")
    assert content_end("mistral", "Sure [TOOL_") == len("Sure ")
    assert content_end("mistral", "Sure [1") == len("Sure [1")
    assert content_end("mistral", "Sure [TOOL_CALLS]f") == len("Sure ")


def test_a_worker_with_auto_tool_choice_needs_a_parser():
    command = [sys.executable, "-m", "tandem.cli", "worker", "--enable-auto-tool-choice"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert finished.returncode != 0
    assert "--enable-auto-tool-choice needs --tool-call-parser" in finished.stderr
