"""Which flow a client body takes, and the prefill leg's body.

A body is served disaggregated (a prefill leg, then a decode leg) when it holds one prompt and
asks for one choice, and no part of its answer needs the worker that computes the prompt
(`needs_one_worker`); every other body goes whole to one worker. These are pure functions of the
body: they never look at the pool.
"""

from __future__ import annotations

from typing import Any

from tandem.pd.params import prefill_kv_params

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def prefill_leg_body(body: dict[str, Any], handoff_id: str | None = None) -> dict[str, Any]:
    """The client body as a prefill leg: not streamed, one token, the PD request fields."""
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    if body.get("min_tokens"):  # the first token may not end the request either
        leg["min_tokens"] = 1
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    leg["kv_transfer_params"] = prefill_kv_params(handoff_id)
    return leg


def wants_one_token(endpoint: str, body: dict[str, Any]) -> bool:
    limit = body.get("max_tokens")
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        limit = body["max_completion_tokens"]
    return limit == 1


def is_single_prompt(endpoint: str, body: dict[str, Any]) -> bool:
    """True unless the request asks for several choices or holds a batch of prompts."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if endpoint == "chat":
        return True
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt) == 1
    return True


def needs_one_worker(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether one worker must answer the request whole: it wants its prompt's logprobs
    (vLLM's prompt_logprobs, or echo with logprobs; only the worker that computes the prompt
    has them), no token at all (max_tokens 0: echo scores the prompt only), or tool calls
    (made of the whole output, where the PD flow streams the first token's text)."""
    if body.get("prompt_logprobs") is not None or body.get("max_tokens") == 0:
        return True
    if endpoint == "chat":
        return bool(body.get("tools")) and body.get("tool_choice") != "none"
    return bool(body.get("echo")) and body.get("logprobs") is not None


def can_disaggregate(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether the body may be served by a prefill leg and a decode leg."""
    return is_single_prompt(endpoint, body) and not needs_one_worker(endpoint, body)


def choice_text(endpoint: str, choice: dict[str, Any], *, streamed: bool) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    holder = choice.get("delta" if streamed else "message") or {}
    return holder.get("content") or ""
