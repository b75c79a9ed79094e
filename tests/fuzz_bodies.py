"""Hostile request bodies for the chaos run and the fuzz tests: the cases a security probe found
(deep nesting, a huge prompt, spoofed PD fields, out-of-range values) and seeded random mutations
of valid bodies. A server must answer each with a status below 500, promptly, and live on."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
VALID = [
    (COMPLETIONS, {"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}),
    (COMPLETIONS, {"prompt": [9, 10, 11], "max_tokens": 2, "stream": True}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 3}),
]
SPOOFED_PD_FIELDS = [
    {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_block_ids": [0],
        "remote_engine_id": "x",
        "remote_request_id": "x",
        "first_token_id": 1,
    },
    {"do_remote_prefill": True, "first_token_id": 1_000_000_000, "remote_block_ids": [0]},
    {"do_remote_prefill": True, "first_token_id": -1, "remote_block_ids": [0]},
    {"do_remote_prefill": True, "first_token_id": "a", "remote_block_ids": [0]},
    {"do_remote_prefill": True, "remote_port": 70000, "first_token_id": 1},
    {"do_remote_prefill": True, "remote_block_ids": [-1, 10**12], "first_token_id": 1},
    {
        "do_remote_prefill": True,
        "handoff_id": "h" * 100_000,
        "remote_host": "127.0.0.1",
        "remote_port": 8200,
    },
    {"do_remote_decode": True},
    {"do_remote_decode": "yes", "do_remote_prefill": [1]},
]
ODD_VALUES: list[Any] = [
    None,
    -1,
    0,
    2**63,
    -(2**70),
    1.5,
    float("1e308"),
    "",
    "x" * 20_000,
    "\ud800",
    [],
    {},
    [[[]]],
    True,
    [1e9],
    {"a": [None]},
    [-5],
    "-1",
]
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "stream",
    "stream_options",
    "echo",
    "min_tokens",
    "prompt_logprobs",
    "guided_choice",
    "guided_regex",
    "guided_json",
    "response_format",
    "structured_outputs",
    "tools",
    "tool_choice",
    "priority",
    "cache_salt",
    "kv_transfer_params",
    "best_of",
    "stop_token_ids",
    "repetition_penalty",
    "min_p",
    "max_completion_tokens",
]


def fixed_cases() -> Iterator[tuple[str, str, bytes]]:
    """The probe's findings and their neighbours."""
    yield "100,000 [", COMPLETIONS, b"[" * 100_000
    yield "50,000 nested objects", COMPLETIONS, b'{"a":' * 50_000 + b"1" + b"}" * 50_000
    yield "nested prompt", COMPLETIONS, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    yield "not JSON", COMPLETIONS, b"{"
    yield "JSON array", CHAT, b"[1, 2]"
    yield "50 MB prompt", COMPLETIONS, _encode({"prompt": "a " * 25_000_000, "max_tokens": 1})
    yield (
        "guided_choice of 10,000",
        COMPLETIONS,
        _encode(
            {"prompt": [5, 6], "max_tokens": 2, "guided_choice": [f"c{i}" for i in range(10_000)]}
        ),
    )
    yield (
        "stop of 10,000",
        COMPLETIONS,
        _encode({"prompt": [5, 6], "max_tokens": 2, "stop": [f"s{i}" for i in range(10_000)]}),
    )
    yield (
        "logit_bias of 100,000",
        COMPLETIONS,
        _encode(
            {"prompt": [5], "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(100_000)}}
        ),
    )
    yield "n of 10**6", COMPLETIONS, _encode({"prompt": [5], "max_tokens": 2, "n": 10**6})
    yield (
        "token ids out of the vocabulary",
        COMPLETIONS,
        _encode({"prompt": [10**9, -1], "max_tokens": 2}),
    )
    yield "10,000 messages", CHAT, _encode({"messages": MESSAGES * 10_000, "max_tokens": 2})
    for index, params in enumerate(SPOOFED_PD_FIELDS):
        for path, body in VALID:
            yield f"spoofed PD fields {index}", path, _encode(dict(body, kv_transfer_params=params))
        yield (
            f"spoofed PD fields {index} with tools",
            CHAT,
            _encode(
                {
                    "messages": MESSAGES,
                    "max_tokens": 3,
                    "kv_transfer_params": params,
                    "tool_choice": "required",
                    "tools": [
                        {
                            "type": "function",
                            "function": {"name": "f", "parameters": {"type": "object"}},
                        }
                    ],
                }
            ),
        )


def hostile_bodies(rng: random.Random, num_mutations: int) -> Iterator[tuple[str, str, bytes]]:
    """The fixed cases, then `num_mutations` valid bodies with one field set to an odd value."""
    yield from fixed_cases()
    for index in range(num_mutations):
        path, body = VALID[rng.randrange(len(VALID))]
        field, value = rng.choice(FIELDS), rng.choice(ODD_VALUES)
        yield (
            f"mutation {index}: {field}={str(value)[:40]!r}",
            path,
            _encode(dict(body, **{field: value})),
        )


def _encode(body: dict[str, Any]) -> bytes:
    # ensure_ascii writes a lone surrogate as the escape a client would send
    return json.dumps(body, ensure_ascii=True).encode()
