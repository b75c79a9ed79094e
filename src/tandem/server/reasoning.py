"""A model's reasoning split off its text (`--reasoning-parser`), as vLLM's reasoning outputs.

* `deepseek_r1`: the text up to `</think>` is reasoning, the rest is content; a leading
  `<think>` is dropped (a template that puts it in the prompt leaves it out of the output). An
  output that ends before `</think>` is all reasoning (DeepSeek-R1, QwQ).
* `qwen3`: the same for an output that begins with `<think>`; one that does not (thinking off,
  `chat_template_kwargs: {"enable_thinking": false}`) is all content (Qwen3).

`split_reasoning` takes a partial output too: then the reasoning is what can go out already
(not what may begin `</think>`) and the content's start is known once `</think>` is.
`structured_output_start` says where a structured output starts in such an answer: after the
reasoning, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.server.tool_calls import partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str | None  # None: the output has no reasoning part
    content_start: int | None  # where the content begins in the text; None: not (yet)

    def content(self, text: str) -> str | None:
        """The content of `text` (the output split); None while its start is not known."""
        return text[self.content_start :] if self.content_start is not None else None


def structured_output_start(tokenizer: Any, prompt_ids: Sequence[int]) -> int | None:
    """The token after which a structured output holds a reasoning model's answer: `</think>`,
    when the tokenizer has it as one token and the prompt has not ended the reasoning already
    (a template that turns thinking off writes both tags); None otherwise (then the grammar
    holds the answer from its first token, and there is no reasoning to split off)."""
    start, end = (_token_id(tokenizer, tag) for tag in (THINK_START, THINK_END))
    if end is None:
        return None
    last = {token_id: index for index, token_id in enumerate(prompt_ids)}
    return None if last.get(end, -1) > last.get(start, -1) else end


def _token_id(tokenizer: Any, text: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(text)
    known = isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == text
    return token_id if known else None


def split_reasoning(parser: str, text: str, finished: bool, known: int = 0) -> ReasoningSplit:
    """The reasoning of an output (so far, when not finished) and where its content begins.
    `known`: characters of reasoning already let go of (no end tag begins in them), which a
    stream's search for the tag skips."""
    opened = text.startswith(THINK_START)
    if not opened and not finished and THINK_START.startswith(text):
        return ReasoningSplit("", None)  # may still open with <think>
    if parser == "qwen3" and not opened:
        return ReasoningSplit(None, 0)
    start = len(THINK_START) if opened else 0
    end = text.find(THINK_END, start + known)
    if end >= 0:
        return ReasoningSplit(text[start:end], end + len(THINK_END))
    if finished:
        return ReasoningSplit(text[start:], None)
    return ReasoningSplit(text[start : len(text) - partial_suffix(text, THINK_END)], None)
