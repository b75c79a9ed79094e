"""The OpenAI stream chunks the router writes itself, and its rewrite of a decode stream's.

In a PD flow the client's stream is made of two workers' answers: its first chunk is built from
the prefill leg's answer (`first_chunk`, or the whole stream with `prefill_only_chunks` when the
prefill answers the request alone), the rest is the decode leg's stream rewritten by
`DecodeChunks`: the router's request id, and no second `role`. The decode worker sends nothing
of the first token (it was told `first_token_sent`): not its id, its logprobs, nor the text the
first chunk holds, so nothing is ever cut here.
"""

from __future__ import annotations

import time
from typing import Any

from tandem.router.relay import DONE_EVENT, sse_event

REASONING_FIELDS = ("reasoning", "reasoning_content")


def chunk(
    endpoint: str,
    request_id: str,
    answer: dict[str, Any],
    text: str,
    finish_reason: str | None,
    *,
    delta: dict[str, Any],
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """A stream chunk of one choice for a request whose prefill leg answered `answer`."""
    if endpoint == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        object_name = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
        object_name = "text_completion"
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = stop_reason
    return {
        "id": request_id,
        "object": object_name,
        "created": answer.get("created", int(time.time())),
        "model": answer.get("model"),
        "choices": [choice],
    }


def usage_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """A streamed request's (include_usage, continuous_usage_stats): the usage chunk at the end,
    and vLLM's usage so far in every chunk (only with include_usage)."""
    options = body.get("stream_options")
    if not isinstance(options, dict):  # the decode worker refuses an odd value itself
        options = {}
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))


def first_chunk(
    endpoint: str, request_id: str, answer: dict[str, Any], text: str, continuous: bool = False
) -> bytes:
    """The first token's event: `text`, and its logprobs and id from the prefill's answer (and
    its usage, one token so far, with `continuous` usage)."""
    event = chunk(
        endpoint, request_id, answer, text, None, delta={"role": "assistant", "content": text}
    )
    if continuous:
        event["usage"] = answer.get("usage")
    prefill_choice = answer["choices"][0]
    message = prefill_choice.get("message") or {}
    for field in REASONING_FIELDS:  # a reasoning parser's split of the first token's text
        if endpoint == "chat" and message.get(field):
            event["choices"][0]["delta"][field] = message[field]
    event["choices"][0]["logprobs"] = prefill_choice.get("logprobs")
    if "token_ids" in prefill_choice:  # the client asked for return_token_ids
        event["choices"][0]["token_ids"] = prefill_choice["token_ids"]
    return sse_event(event)


def prefill_only_chunks(
    endpoint: str, request_id: str, answer: dict[str, Any], text: str, body: dict[str, Any]
) -> list[bytes]:
    """A whole streamed answer, for a request of `body`, made from the prefill leg's answer."""
    include_usage, continuous = usage_options(body)
    prefill_choice = answer["choices"][0]
    last = chunk(
        endpoint, request_id, answer, "", prefill_choice.get("finish_reason"), delta={},
        stop_reason=prefill_choice.get("stop_reason"),
    )  # fmt: skip
    if continuous:
        last["usage"] = answer.get("usage")
    events = [first_chunk(endpoint, request_id, answer, text, continuous), sse_event(last)]
    if include_usage:
        usage_chunk = chunk(endpoint, request_id, answer, "", None, delta={})
        usage_chunk["choices"] = []
        usage_chunk["usage"] = answer.get("usage")
        events.append(sse_event(usage_chunk))
    events.append(DONE_EVENT)
    return events


class DecodeChunks:
    """Rewrites a decode stream's chunks, in order, for the client (see the module's text)."""

    def __init__(self, endpoint: str, request_id: str) -> None:
        self.endpoint = endpoint
        self.request_id = request_id

    def rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk for the client, or None when nothing is left of it."""
        event["id"] = self.request_id
        choices = event.get("choices") or []
        for choice in choices:
            if self.endpoint == "chat":
                (choice.get("delta") or {}).pop("role", None)
        # a chunk whose choices are empty says nothing new, even with its running usage
        # (continuous_usage_stats): the decode's role chunk, counting 0 after the first token
        if choices and all(map(self._is_empty, choices)):
            return None
        return event

    def _is_empty(self, choice: dict[str, Any]) -> bool:
        """True for a choice that carries nothing for the client."""
        if (
            choice.get("finish_reason") is not None
            or choice.get("logprobs")
            or choice.get("token_ids")
        ):
            return False
        if self.endpoint == "completions":
            return not choice.get("text")
        return not any((choice.get("delta") or {}).values())
