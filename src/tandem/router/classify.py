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
    """The client body as a prefill leg: not streamed, the PD request fields. Its limits stay
    the client's: the prefill worker checks them as the decode would (a prompt that leaves no
    room for max_tokens is refused before it is computed), then samples one token."""
    # a whole answer's stream_options stay, for the prefill worker to refuse as the decode would
    dropped = ("stream", "stream_options") if body.get("stream") else ("stream",)
    leg = {k: v for k, v in body.items() if k not in dropped}
    leg["stream"] = False
    leg["kv_transfer_params"] = prefill_kv_params(handoff_id)
    return leg


def wants_one_token(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether the request's output is one token (max_completion_tokens before max_tokens, on
    both endpoints, as the workers read them)."""
    limit = body.get("max_completion_tokens")
    return (body.get("max_tokens") if limit is None else limit) == 1


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
    has them), no token at all (max_tokens 0: echo scores the prompt only), its prompt (or a
    chat's last message) echoed (the answer's text and stream start with it), or tool calls
    (made of the whole output, where the PD flow streams the first token's text)."""
    if body.get("prompt_logprobs") is not None or body.get("max_tokens") == 0:
        return True
    if body.get("echo"):
        return True
    return endpoint == "chat" and bool(body.get("tools")) and body.get("tool_choice") != "none"


def can_disaggregate(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether the body may be served by a prefill leg and a decode leg."""
    return is_single_prompt(endpoint, body) and not needs_one_worker(endpoint, body)


def choice_text(endpoint: str, choice: dict[str, Any], *, streamed: bool) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    holder = choice.get("delta" if streamed else "message") or {}
    return holder.get("content") or ""
