"""Reasoning split off a model's text (`--reasoning-parser`): each parser's reasoning and
content for outputs written out by hand, and the streaming contract: what an unfinished output
lets go of as reasoning, and its content once known, always start the whole output's. Then a
structured output after the reasoning: where it starts, for prompts written by hand, and a
worker on a tiny checkpoint whose tokenizer has the tags, against the offline engine. Last, the
routers' PD flows on that checkpoint split a chat answer as a `both` worker does, though the
client's first token comes from the prefill worker and the decode worker streams the rest."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from pd_fixtures import read_stream, running_routers, running_workers
from tandem import LLM, SamplingParams
from tandem.engine.structured_output import StructuredOutput
from tandem.server.reasoning import split_reasoning, structured_output_start
from tiny_models import byte_level_bpe
from worker_fixtures import running_worker


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


CITIES = ["Paris", "London", "Lisbon"]
# A DeepSeek-R1-like template: the prompt opens the reasoning, unless thinking is turned off,
# when it writes both tags.
TEMPLATE = (
    "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with `<think>` and `</think>` as tokens of their own
    (added, not special: they stay in the text, as in Qwen3's and DeepSeek-R1's)."""
    core = byte_level_bpe([" ".join(CITIES) + " pick a city for me"] * 10, 300)
    core.add_tokens(["<think>", "</think>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")


def test_a_structured_output_starts_after_the_reasoning_the_prompt_left_open(thinking_tokenizer):
    start, end = thinking_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert structured_output_start(thinking_tokenizer, [5, 6]) == end  # the answer opens it
    assert structured_output_start(thinking_tokenizer, [5, start]) == end  # the prompt did
    assert structured_output_start(thinking_tokenizer, [5, start, 6, end]) is None  # closed
    assert structured_output_start(thinking_tokenizer, [start, end, 5, start]) == end  # again
    without_tags = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    assert structured_output_start(without_tags, [5, 6]) is None  # no tag to wait for


@pytest.mark.slow  # 22 s; the parser and where the grammar starts are unit-tested above
def test_a_worker_holds_only_the_answer_after_the_reasoning(
    thinking_tokenizer, tiny_checkpoints, tmp_path
):
    """A worker with --reasoning-parser deepseek_r1 on a tiny checkpoint: a choice held after
    the reasoning (the end tag forced first by a logit bias, which the grammar then masks) is
    the offline engine's output with the grammar after `</think>`, split at the tag, collected
    and streamed; a forced tool call's arguments begin after the tag too; with thinking turned
    off in the prompt, the grammar holds the whole answer (no end tag despite the bias) and
    nothing is split off."""
    checkpoint = tmp_path / "thinking"
    shutil.copytree(tiny_checkpoints["llama-gqa"], checkpoint)
    thinking_tokenizer.save_pretrained(checkpoint)
    end = thinking_tokenizer.convert_tokens_to_ids("</think>")
    messages = [{"role": "user", "content": "pick a city"}]
    body = {
        "messages": messages,
        "temperature": 0,
        "max_tokens": 12,
        "structured_outputs": {"choice": CITIES},
        "logit_bias": {str(end): 100},
        "return_token_ids": True,
    }
    flags = ("--reasoning-parser", "deepseek_r1", "--chat-template", TEMPLATE)
    with running_worker(tmp_path, *flags, model=str(checkpoint)) as worker:
        chat = worker.url + "/v1/chat/completions"
        prompt = httpx.post(worker.url + "/tokenize", json={"messages": messages}).json()
        llm = LLM(str(checkpoint), device="cpu", num_kv_blocks=64, block_size=8)
        (reference,) = llm.generate(
            [prompt["tokens"]],
            SamplingParams(
                temperature=0,
                max_tokens=12,
                structured_output=StructuredOutput(choice=CITIES),
                structured_output_after=end,
                logit_bias={end: 100},
            ),
        )
        assert reference.outputs[0].token_ids[0] == end
        reasoning, _, content = reference.outputs[0].text.partition("</think>")
        assert content in CITIES

        choice = httpx.post(chat, json=body, timeout=60).json()["choices"][0]
        assert choice["token_ids"] == reference.outputs[0].token_ids
        message = choice["message"]
        assert (message["reasoning"], message["content"]) == (reasoning, content)
        assert choice["finish_reason"] == "stop"
        with httpx.stream("POST", chat, json={**body, "stream": True}, timeout=60) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        pieces = [json.loads(line)["choices"][0]["delta"] for line in lines]
        assert "".join(d.get("content") or "" for d in pieces) == content
        assert not any("</think>" in (d.get("content") or "") for d in pieces)

        # A forced tool call too (this model writes the schema's whitespace until max_tokens:
        # the call is cut short, its arguments begun after the tag).
        schema = {"type": "object", "properties": {"city": {"enum": CITIES}}, "required": ["city"]}
        tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
        forced = {key: value for key, value in body.items() if key != "structured_outputs"}
        forced.update(tools=[tool], tool_choice={"type": "function", "function": {"name": "pick"}})
        choice = httpx.post(chat, json=forced, timeout=60).json()["choices"][0]
        assert choice["token_ids"][0] == end and choice["message"]["reasoning"] == ""
        assert choice["message"]["content"].startswith("{")

        unusable = httpx.post(chat, json={**body, "structured_outputs": {"regex": "("}})
        assert unusable.status_code == 400, unusable.text

        thinking_off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
        choice = httpx.post(chat, json=thinking_off, timeout=60).json()["choices"][0]
        assert end not in choice["token_ids"]
        assert choice["message"]["content"] in CITIES
        assert choice["message"].get("reasoning") is None


# Logit biases that make the tiny checkpoint's greedy answer (worked out in the offline engine:
# the penalties below push each biased token under the next one once it was written):
# qwen3: "<think>Paris London</think> Lisbon<think>...", reasoning that the first token opens;
# deepseek_r1: "</think>Paris London Lisbon</think>...", a first token that ends the reasoning
# the prompt opened, so all that follows is content.
FORCED_ANSWERS = {
    "qwen3": ("<think>", "Paris", "</think>", "ĠLondon", "ĠLisbon"),
    "deepseek_r1": ("</think>", "Paris", "ĠLondon", "ĠLisbon"),
}


@pytest.fixture(scope="module", params=list(FORCED_ANSWERS))
def reasoning_cluster(request, thinking_tokenizer, tiny_checkpoints, tmp_path_factory):
    """A prefill, a decode and a `both` worker with one reasoning parser, and routers over the
    first two (a handoff's and vLLM's flow)."""
    parser = request.param
    log_dir = tmp_path_factory.mktemp(f"pd-{parser}")
    checkpoint = log_dir / "thinking"
    shutil.copytree(tiny_checkpoints["llama-gqa"], checkpoint)
    thinking_tokenizer.save_pretrained(checkpoint)
    flags = ("--reasoning-parser", parser, "--chat-template", TEMPLATE, "--num-kv-blocks", "64")
    specs = {role: ("--role", role, *flags) for role in ("prefill", "decode", "both")}
    with (
        running_workers(log_dir, specs, str(checkpoint)) as workers,
        running_routers(log_dir, workers["prefill"].url, workers["decode"].url) as routers,
    ):
        yield parser, workers, routers


def reasoning_and_content(client: httpx.Client, url: str, body: dict) -> tuple[str, str | None]:
    """A chat answer's (reasoning, content), from its message or assembled from its chunks;
    reasoning and reasoning_content must agree."""
    if not body.get("stream"):
        response = client.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert message.get("reasoning") == message.get("reasoning_content"), message
        return message.get("reasoning_content") or "", message["content"]
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        chunks = read_stream(response)
    deltas = [choice["delta"] for chunk in chunks for choice in chunk["choices"]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas), deltas
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning, content or None


@pytest.mark.slow  # four workers and two routers per parser; tests/test_pd_first_token.py is fast
@pytest.mark.parametrize("stop", [None, ["\x00zz"]], ids=["no stop", "held back"])
def test_reasoning_through_the_routers_pd_flow_is_the_both_workers(
    reasoning_cluster, thinking_tokenizer, stop
):
    """The decode worker's parser sees the first token's text, which the router sent the
    client itself: each router's answer, streamed and whole, splits reasoning from content
    as the `both` worker does (a stop string that never matches holds text back)."""
    parser, workers, routers = reasoning_cluster
    forced = thinking_tokenizer.convert_tokens_to_ids(list(FORCED_ANSWERS[parser]))
    body = {
        "messages": [{"role": "user", "content": "pick a city"}],
        "temperature": 0,
        "max_tokens": 10,
        "logit_bias": {str(token): 100 - rank for rank, token in enumerate(forced)},
        "presence_penalty": 2.0,
        "frequency_penalty": 2.0,
        "stop": stop,
    }
    with httpx.Client() as client:
        for stream in (True, False):
            request = {**body, "stream": stream}
            reference = reasoning_and_content(client, workers["both"].url, request)
            if parser == "qwen3":
                assert reference[0].startswith("Paris") and "Lisbon" in reference[1]
            else:
                assert reference[0] == "" and reference[1].startswith("Paris")
            for flow, router in routers.items():
                answer = reasoning_and_content(client, router.url, request)
                assert answer == reference, (flow, stream)
