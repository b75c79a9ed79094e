"""Reasoning split off a model's text (`--reasoning-parser`): each parser's reasoning and
content for outputs written out by hand, and the streaming contract: what an unfinished output
lets go of as reasoning, and its content once known, always start the whole output's."""

from __future__ import annotations

import pytest

from tandem.server.reasoning import split_reasoning


def parts(parser: str, text: str, finished: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of an output; content None while its start is not known."""
    split = split_reasoning(parser, text, finished)
    return split.reasoning, split.content(text)


CASES = [
    ("deepseek_r1", "<think>\nHmm.\n</think>\n\nParis.", ("\nHmm.\n", "\n\nParis.")),
    ("deepseek_r1", "Hmm.\n</think>Paris.", ("Hmm.\n", "Paris.")),  # <think> was in the prompt
    ("deepseek_r1", "<think>Still thinking", ("Still thinking", None)),  # cut short
    ("deepseek_r1", "Paris.", ("Paris.", None)),  # no end tag: all reasoning
    ("deepseek_r1", "<think></think>Paris", ("", "Paris")),
    ("deepseek_r1", "<thi", ("<thi", None)),
    ("deepseek_r1", "a </th b </think> c </think>", ("a </th b ", " c </think>")),
    ("qwen3", "<think>\nHmm.\n</think>\n\nParis.", ("\nHmm.\n", "\n\nParis.")),
    ("qwen3", "<think>cut", ("cut", None)),
    ("qwen3", "Paris.", (None, "Paris.")),  # thinking off: all content
    ("qwen3", "Hmm.</think>Paris", (None, "Hmm.</think>Paris")),  # not opened: all content
    ("qwen3", "<thi", (None, "<thi")),
]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_reasoning_and_content(parser, text, expected):
    assert parts(parser, text) == expected


@pytest.mark.parametrize(("parser", "text"), [(parser, text) for parser, text, _ in CASES])
def test_streamed_reasoning_and_content_are_never_taken_back(parser, text):
    """At every length of the growing output, the reasoning so far starts the whole output's,
    and the content, once its start is known, starts the whole output's content."""
    reasoning, content = parts(parser, text)
    sent = 0
    for length in range(len(text) + 1):
        reasoning_so_far, content_so_far = parts(parser, text[:length], finished=False)
        assert (reasoning or "").startswith(reasoning_so_far or ""), text[:length]
        if content_so_far is not None:
            assert content is not None and content.startswith(content_so_far), text[:length]
        # a stream skips the reasoning it sent in its search for the end tag: the same split
        split = split_reasoning(parser, text[:length], finished=False, known=sent)
        assert split == split_reasoning(parser, text[:length], finished=False)
        sent = len(split.reasoning or "")


def test_what_may_begin_the_end_tag_is_held():
    assert parts("deepseek_r1", "<think>Hmm </thi", finished=False) == ("Hmm ", None)
    assert parts("deepseek_r1", "<think>Hmm </b", finished=False) == ("Hmm </b", None)
    assert parts("qwen3", "<th", finished=False) == ("", None)  # may still open
