"""Incremental detokenization and stop strings with the default model's real tokenizer.

The reference for every delta stream is the tokenizer's own decode of the whole sequence; the
reference for stop strings is str.find on that text. The texts include emoji, CJK and Hangul,
whose characters this byte-level tokenizer splits over several tokens.
"""

from __future__ import annotations

import random

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer, TextState
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.processor import OutputProcessor
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストを正しく表示する。",
    "中文和English混合 text，还有标点！",
    "Emoji: 🦙🚀👩‍👩‍👧 done",
    "🙂🙂🙂🙂🙂",
    "naïve café — “quotes” and ‘apostrophes’",
    "  leading spaces\n\nand newlines\ttabs",
    "한국어 텍스트",
    "Math: ∑ ∫ √ ∞ ≠ ≤ ½",
    "code: def f(x):\n    return x ** 2  # 🐍",
]


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.models.gguf_loader import load_gguf_tokenizer, resolve_default_model

    return load_gguf_tokenizer(resolve_default_model())


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return list(tokenizer("Reply with the text:").input_ids)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def stream(state: TextState, token_ids: list[int]) -> tuple[list[str], str | None]:
    """Feed tokens one by one as the front end does; the deltas sent and the stop string hit."""
    deltas = []
    for token_id in token_ids:
        stop = state.add_token(token_id)
        deltas.append(state.take_delta(finished=stop is not None))
        if stop is not None:
            return deltas, stop
    deltas.append(state.take_delta(finished=True))
    return deltas, None


def test_texts_split_characters_over_tokens(tokenizer):
    """The cases below are only meaningful if some characters span several tokens."""
    split = [
        t for t in TEXTS if any("\ufffd" in tokenizer.decode([i]) for i in encode(tokenizer, t))
    ]
    assert len(split) >= 6


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, prompt_ids, text):
    output_ids = encode(tokenizer, text)
    prompt_text = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(prompt_ids + output_ids)
    assert whole.startswith(prompt_text)
    expected = whole[len(prompt_text) :]
    assert expected == text  # this tokenizer round-trips these texts

    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    deltas = [detokenizer.add(token_id) for token_id in output_ids]
    assert "".join(deltas) == expected
    assert not any("\ufffd" in delta for delta in deltas)
    # Streaming through TextState (no stop strings) sends the same text, nothing held back.
    state = TextState(tokenizer, prompt_ids, SamplingParams())
    sent, stop = stream(state, output_ids)
    assert stop is None and "".join(sent) == expected and sent[-1] == ""


def test_leading_space_of_the_first_token_is_kept(tokenizer, prompt_ids):
    output_ids = encode(tokenizer, " Paris is the capital.")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    assert "".join(detokenizer.add(t) for t in output_ids) == " Paris is the capital."


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer, prompt_ids, skip_special_tokens):
    output_ids = encode(tokenizer, "Done 🦙") + [tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    text = "".join(detokenizer.add(t) for t in output_ids)
    assert text == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert text == ("Done 🦙" if skip_special_tokens else "Done 🦙" + tokenizer.eos_token)


def test_random_token_streams_lose_nothing(tokenizer, prompt_ids):
    """Arbitrary ids (lone UTF-8 continuation bytes included): what was sent is the whole decode,
    except an incomplete character at the very end, which is never sent."""
    rng = random.Random(0)
    byte_tokens = [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]
    for _ in range(30):
        output_ids = [
            rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(3, 49152)
            for _ in range(rng.randrange(1, 25))
        ]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
        sent = "".join(detokenizer.add(t) for t in output_ids)
        whole = tokenizer.decode(output_ids)
        assert whole.startswith(sent)
        assert sent == whole or whole.endswith("\ufffd")


@pytest.mark.parametrize(
    ("text", "stops", "expected_text", "expected_stop"),
    [
        ("Hello world. The end.", ["world"], "Hello ", "world"),
        ("Hello world. The end.", ["lo wo"], "Hel", "lo wo"),  # spans "Hello" and " world"
        ("Hello world. The end.", [". The e"], "Hello world", ". The e"),  # spans three tokens
        ("Hello world. The end.", ["end", "The"], "Hello world. ", "The"),  # the earliest wins
        ("Hello world. The end.", ["xyz"], "Hello world. The end.", None),
        ("Emoji: 🦙🚀 done", ["🚀"], "Emoji: 🦙", "🚀"),  # a stop inside multi-token characters
        ("日本語のテキストを正しく表示する。", ["正しく"], "日本語のテキストを", "正しく"),
        ("aaaa", ["aa"], "", "aa"),
    ],
)
def test_stop_strings_cut_the_text(
    tokenizer, prompt_ids, text, stops, expected_text, expected_stop
):
    assert (text.find(expected_stop) if expected_stop else len(text)) == len(expected_text)
    state = TextState(tokenizer, prompt_ids, SamplingParams(stop=stops))
    sent, stop = stream(state, encode(tokenizer, text))
    assert stop == expected_stop
    assert state.text == expected_text
    assert "".join(sent) == expected_text


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The answer is 42. STOP here", "STOP"),
        ("one two three four five six", "three four"),
        ("Hello wor", "world"),  # a stop string that never completes: held, then sent at the end
        ("abababababac", "ababac"),
        ("数学: ∑ ∫ √ ∞ ≠ ≤", "∞ ≠"),
    ],
)
def test_streaming_never_sends_part_of_a_stop_string(tokenizer, prompt_ids, text, stop):
    cut = text.find(stop)
    final = text if cut < 0 else text[:cut]
    state = TextState(tokenizer, prompt_ids, SamplingParams(stop=[stop]))
    sent_so_far = ""
    token_ids = encode(tokenizer, text)
    deltas, _ = stream(state, token_ids)
    for delta in deltas:
        sent_so_far += delta
        assert final.startswith(sent_so_far)
    assert sent_so_far == final
    if cut < 0:  # before finishing, the last len(stop) - 1 characters were held back
        assert "".join(deltas[:-1]) == text[: len(text) - (len(stop) - 1)]


def make_processor(tokenizer, prompt_ids, params: SamplingParams) -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    eos = frozenset({tokenizer.eos_token_id})
    processor.add("req", Request("req-0", list(prompt_ids), params, eos_token_ids=eos), 0)
    return processor


def test_output_processor_reports_stop_strings(tokenizer, prompt_ids):
    processor = make_processor(tokenizer, prompt_ids, SamplingParams(stop=[" end"]))
    token_ids = encode(tokenizer, "Hello world. The end. More")
    texts = []
    for token_id in token_ids:
        deltas, stopped = processor.process([EngineCoreOutput("req-0", [token_id])])
        (delta,) = deltas
        texts.append(delta.text)
        if delta.finish_reason is not None:
            break
    assert len(texts) == token_ids.index(encode(tokenizer, " end")[0]) + 1
    assert stopped == ["req-0"]  # the caller aborts it in the core
    assert (delta.finish_reason, delta.stop_reason) == ("stop", " end")
    assert "".join(texts) == "Hello world. The"
    assert processor.states == {}


def test_output_processor_drops_the_text_of_a_stopping_token(tokenizer, prompt_ids):
    """EOS or a stop token id ends the request; its own text is not part of the output."""
    token_ids = encode(tokenizer, "Bye!")
    params = SamplingParams(stop_token_ids=[token_ids[-1]], skip_special_tokens=False)
    for stopping_token in (token_ids[-1], tokenizer.eos_token_id):
        processor = make_processor(tokenizer, prompt_ids, params)
        sent = token_ids[:-1] + [stopping_token]
        deltas, stopped = processor.process([EngineCoreOutput("req-0", sent, finish_reason="stop")])
        (delta,) = deltas
        assert (delta.text, delta.token_ids, delta.finish_reason) == ("Bye", sent, "stop")
        assert stopped == []


def test_include_stop_str_in_output_keeps_the_stop_in_the_text(tokenizer, prompt_ids):
    """With include_stop_str_in_output the text ends after the stop string, and nothing is held
    back while streaming (all text before the stop's end is output); a stop token or EOS keeps
    its text too."""
    text, stop = "one two three four five six", "three four"
    params = SamplingParams(stop=[stop], include_stop_str_in_output=True)
    state = TextState(tokenizer, prompt_ids, params)
    token_ids = encode(tokenizer, text)
    sent_so_far = ""
    for token_id in token_ids:
        found = state.add_token(token_id)
        sent_so_far += state.take_delta(finished=found is not None)
        assert sent_so_far == state.text  # nothing held back
        if found is not None:
            break
    assert found == stop and state.text == "one two three four"

    token_ids = encode(tokenizer, "Bye!")
    params = SamplingParams(stop_token_ids=[token_ids[-1]], include_stop_str_in_output=True)
    processor = make_processor(tokenizer, prompt_ids, params)
    deltas, _ = processor.process([EngineCoreOutput("req-0", token_ids, finish_reason="stop")])
    assert (deltas[0].text, deltas[0].finish_reason) == ("Bye!", "stop")


def test_output_processor_keeps_the_text_of_a_token_that_completes_a_grammar(tokenizer, prompt_ids):
    """A stop on any other token (a structured output's grammar completed by it) keeps it."""
    token_ids = encode(tokenizer, "Bye!")
    processor = make_processor(tokenizer, prompt_ids, SamplingParams())
    deltas, _ = processor.process([EngineCoreOutput("req-0", token_ids, finish_reason="stop")])
    assert (deltas[0].text, deltas[0].finish_reason) == ("Bye!", "stop")
