"""Tool calls found in a model's free text, for tool_choice "auto" (`--tool-call-parser`).

Each parser knows one output format:

* `hermes`: each call is JSON between `<tool_call>` and `</tool_call>`, `{"name": ...,
  "arguments": {...}}` (Qwen2.5, Qwen3, Hermes); a JSON list of such objects inside one pair (as
  SmolLM2 writes them) is taken too, and so is a last pair the output ended before closing. The
  text before the first `<tool_call>` is the message's content.
* `llama3_json`: the whole output is one or more `{"name": ..., "parameters": {...}}` objects,
  separated by `;`, perhaps after `<|python_tag|>` (Llama 3.1 and 3.2).
* `mistral`: the calls follow the `[TOOL_CALLS]` token, as a JSON list of `{"name": ...,
  "arguments": {...}}` objects (Mistral 7B v0.3, Nemo, Small before 3.1), or as `name[ARGS]{...}`
  after each such token (Mistral's tokenizers from v11 on). Both tokens are special: a request
  parsed this way keeps special tokens in its text (`KEEPS_SPECIAL_TOKENS`), as in vLLM. The text
  before the first `[TOOL_CALLS]` is the message's content.
* `pythonic`: the whole output is a Python list of calls with keyword arguments of literal
  values, `[get_weather(city="Paris"), get_time()]`, perhaps between `<|python_start|>` and
  `<|python_end|>` (Llama 3.2 and 4 in their pythonic templates, ToolACE).

An output whose calls are not all valid JSON of that shape is content, with no calls, as in vLLM.
While a response streams, `content_end` says how much of the text so far is surely content (the
rest may begin a call) and `calls_so_far` gives the calls begun: one written as an object, name
first (as above, or mistral's `name[ARGS]{...}`), streams once its name is known, its arguments
as the raw JSON text the model writes; from a call in another shape on, the calls wait for the
whole output."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})  # its markers are special tokens

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(
    re.escape(HERMES_START) + r"(.*?)(?:" + re.escape(HERMES_END) + r"|\Z)", re.DOTALL
)
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_FUNCTION_NAME = re.compile(r"[\w.-]+")
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_MARKERS = {"hermes": HERMES_START, "mistral": MISTRAL_CALLS}  # formats whose calls follow one
# The formats that are the whole output: the character a call begins with, and a tag before it.
_WHOLE_OUTPUT_STARTS = {"llama3_json": ("{", PYTHON_TAG), "pythonic": ("[", PYTHON_START)}
_SEPARATOR = re.compile(r"\s*(?:;\s*|\Z)")  # between two llama3_json calls, or at the end
# The beginning of a call written as an object, up to its arguments object: the name (a JSON
# string) in group 1; and mistral's `name[ARGS]` before an object, the name in group 1.
_OBJECT_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_MISTRAL_CALL_HEAD = re.compile(r"\s*([\w.-]+)" + re.escape(MISTRAL_ARGS) + r"\s*(?=\{)")
_CLOSING_BRACE, _LIST_START = re.compile(r"\s*\}"), re.compile(r"\s*\[")
_SEMICOLON, _COMMA = re.compile(r"\s*;"), re.compile(r"\s*,")  # between two streamed calls
_DECODER = json.JSONDecoder()


@dataclass
class ParsedOutput:
    content: str | None  # None when the output holds only calls
    calls: list[tuple[str, str]]  # (function name, arguments as a JSON string)


@dataclass
class CallSoFar:
    """A call an output has begun: its name, and its arguments as the raw JSON text written so
    far (the whole object once `complete`)."""

    name: str
    arguments: str
    complete: bool


def parse_tool_calls(parser: str, text: str) -> ParsedOutput:
    """The output's content and calls, in the format `parser` names."""
    return _PARSERS[parser](text)


def content_end(parser: str, text: str) -> int:
    """How many leading characters of a partial output are content whatever follows."""
    if parser in _MARKERS:
        marker = _MARKERS[parser]
        start = text.find(marker)
        return start if start >= 0 else len(text) - partial_suffix(text, marker)
    opening, tag = _WHOLE_OUTPUT_STARTS[parser]
    head = text.lstrip()
    if not head or head.startswith(opening) or tag.startswith(head[: len(tag)]):
        return 0  # may still become calls
    return len(text)


def calls_so_far(parser: str, text: str) -> list[CallSoFar]:
    """The calls a partial output has begun that can be streamed, in order (see above)."""
    if parser == "llama3_json":
        head = text.lstrip()
        position = len(text) - len(head) + (len(PYTHON_TAG) if head.startswith(PYTHON_TAG) else 0)
        return _object_calls(text, position, _SEMICOLON)[0]
    if parser not in _MARKERS:
        return []  # pythonic: whole calls only
    marker, calls = _MARKERS[parser], []
    position = text.find(marker)
    while position >= 0:
        position += len(marker)
        if (bracket := _LIST_START.match(text, position)) is not None:
            found, end = _object_calls(text, bracket.end(), _COMMA)  # a list of calls
        elif parser == "mistral" and (call := _mistral_call_at(text, position)) is not None:
            found, end = [call[0]], call[1] if call[0].complete else None
        else:
            found, end = _object_calls(text, position, None)
        calls += found
        if end is None:
            break
        position = text.find(marker, end)
    return calls


def _object_calls(
    text: str, position: int, separator: re.Pattern[str] | None
) -> tuple[list[CallSoFar], int | None]:
    """The calls written as objects from `position` on, `separator` between two (None: one
    call alone); and where the last one ends, None while a call is unfinished or followed by
    something other than its closing brace."""
    calls: list[CallSoFar] = []
    while (call := _object_call_at(text, position)) is not None:
        calls.append(call[0])
        closing = _CLOSING_BRACE.match(text, call[1]) if call[0].complete else None
        if closing is None:
            return calls, None
        following = None if separator is None else separator.match(text, closing.end())
        if following is None:
            return calls, closing.end()
        position = following.end()
    return calls, None


def _object_call_at(text: str, position: int) -> tuple[CallSoFar, int] | None:
    """The call `{"name": ..., "arguments": {...` begun at `position`, and where its arguments
    end (or the text does); None if the text there begins no such call (yet)."""
    head = _OBJECT_CALL_HEAD.match(text, position)
    if head is None:
        return None
    try:
        name = json.loads(head.group(1))
    except ValueError:
        return None
    return _arguments_from(text, name, head.end())


def _mistral_call_at(text: str, position: int) -> tuple[CallSoFar, int] | None:
    head = _MISTRAL_CALL_HEAD.match(text, position)
    return None if head is None else _arguments_from(text, head.group(1), head.end())


def _arguments_from(text: str, name: str, start: int) -> tuple[CallSoFar, int]:
    """The call whose arguments object begins at `start`: whole if it is complete JSON, else
    the text so far (an unfinished JSON value holds all that follows its beginning)."""
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return CallSoFar(name, text[start:], complete=False), len(text)
    return CallSoFar(name, text[start:end], complete=True), end


def _parse_hermes(text: str) -> ParsedOutput:
    start = text.find(HERMES_START)
    if start < 0:
        return ParsedOutput(text, [])
    calls: list[tuple[str, str]] = []
    for body in _HERMES_CALL.findall(text, start):
        try:
            value = json.loads(body)
        except ValueError:
            return ParsedOutput(text, [])
        found = _calls_of(value if isinstance(value, list) else [value])
        if not found:
            return ParsedOutput(text, [])
        calls += found
    return ParsedOutput(text[:start] or None, calls)


def _parse_mistral(text: str) -> ParsedOutput:
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return ParsedOutput(text, [])
    calls: list[tuple[str, str]] = []
    for segment in text[start:].split(MISTRAL_CALLS)[1:]:
        as_json = segment.lstrip().startswith(("[", "{"))  # else name[ARGS]{...}
        name, _, arguments = segment.partition(MISTRAL_ARGS)
        try:
            value = json.loads(segment if as_json else arguments)
        except ValueError:
            return ParsedOutput(text, [])
        if as_json:
            found = _calls_of(value if isinstance(value, list) else [value])
        else:
            name = name.strip()
            valid = _FUNCTION_NAME.fullmatch(name) and isinstance(value, dict)
            found = [(name, json.dumps(value, ensure_ascii=False))] if valid else []
        if not found:
            return ParsedOutput(text, [])
        calls += found
    return ParsedOutput(text[:start] or None, calls)


def _parse_llama3_json(text: str) -> ParsedOutput:
    rest = text.strip().removeprefix(PYTHON_TAG).lstrip()
    if not rest.startswith("{"):
        return ParsedOutput(text, [])
    decoder, values, position = json.JSONDecoder(), [], 0
    while position < len(rest):
        try:
            value, position = decoder.raw_decode(rest, position)
        except ValueError:
            return ParsedOutput(text, [])
        values.append(value)
        separator = _SEPARATOR.match(rest, position)
        if separator is None:
            return ParsedOutput(text, [])  # something other than ";" between two objects
        position = separator.end()
    calls = _calls_of(values)
    return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])


def _parse_pythonic(text: str) -> ParsedOutput:
    rest = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if not rest.startswith("["):
        return ParsedOutput(text, [])
    try:
        tree = ast.parse(rest, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return ParsedOutput(text, [])
        calls = [_pythonic_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return ParsedOutput(text, [])
    return ParsedOutput(None, calls)


def _pythonic_call(node: ast.expr) -> tuple[str, str]:
    """(name, arguments JSON) of `name(key=literal, ...)`; ValueError for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call with keyword arguments")
    if any(keyword.arg is None for keyword in node.keywords):
        raise ValueError("**kwargs in a call")
    arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)


_PARSERS = {
    "hermes": _parse_hermes,
    "llama3_json": _parse_llama3_json,
    "mistral": _parse_mistral,
    "pythonic": _parse_pythonic,
}


def _calls_of(values: list[Any]) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each value; empty unless every value is a call. The arguments
    may be named "arguments" or "parameters"."""
    calls = []
    for value in values:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append((value["name"], arguments))
    return calls


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 when none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
