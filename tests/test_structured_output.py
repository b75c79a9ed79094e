"""Structured outputs on a tiny random checkpoint with a byte-level BPE tokenizer of its 512
tokens: the grammar's token masks against masks worked out by hand from the tokens' text, the
offline engine's constrained output against a loop over transformers' own model that masks by
hand, and outputs that parse as their JSON schema or match their regex."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tandem import LLM, SamplingParams
from tandem.engine.structured_output import (
    GrammarBackend,
    StructuredOutput,
    UnsatisfiableConstraint,
    apply_grammar_bitmasks,
    grammar_bitmasks,
    tokenizer_json,
)
from tiny_models import byte_level_bpe

SHAPE = "llama-gqa"
VOCAB = 512
EOS = 0  # "<|end|>", the tokenizer's first (special) token
CORPUS = [
    '{"ok": true, "level": "high", "count": 7}',
    '{"ok": false, "level": "low", "count": 0}',
    "the quick brown fox jumps over the lazy dog 0123456789",
    "abba baab aabb bbaa ab ba aa bb cab cabbage abc",
    "Paris London Berlin Madrid Rome Lisbon",
    " ".join(a + b + c for a in "bcdfgklmnprstvwz" for b in "aeiou" for c in "nrstlm"),
] * 20


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    core = byte_level_bpe(CORPUS, VOCAB)
    assert core.get_vocab_size() == VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")


def apply_grammar_masks(logits: torch.Tensor, grammars: list) -> torch.Tensor:
    """The logits as the sampler masks them, with the bitmasks the scheduler computes."""
    return apply_grammar_bitmasks(logits, grammar_bitmasks(grammars))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, tokenizer, tmp_path_factory):
    """The tiny checkpoint with the tokenizer beside it."""
    directory = tmp_path_factory.mktemp("with-tokenizer") / SHAPE
    shutil.copytree(tiny_checkpoints[SHAPE], directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(checkpoint, request) -> LLM:
    """The engine, scheduling synchronously or asynchronously (whose steps with a grammar are
    then taken at once: the next step's mask needs the token)."""
    return LLM(
        str(checkpoint),
        device="cpu",
        num_kv_blocks=128,
        block_size=8,
        async_scheduling=request.param,
    )


@pytest.fixture(scope="module")
def grammars(tokenizer) -> GrammarBackend:
    backend = GrammarBackend(VOCAB)
    backend.set_tokenizer(tokenizer_json(tokenizer), [EOS])
    return backend


def token_texts(tokenizer) -> list[str]:
    return [tokenizer.decode([token_id]) for token_id in range(VOCAB)]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    return torch.device(request.param)


def test_masks_allow_exactly_the_tokens_the_regex_can_take(tokenizer, grammars, device):
    texts = token_texts(tokenizer)
    can_start = {t for t, text in enumerate(texts) if t != EOS and re.fullmatch("[ab]+", text)}
    assert len(can_start) > 2  # "a", "b" and merges of them
    outputs: list[int] = []
    grammar = grammars.matcher(StructuredOutput(regex="[ab]+"), outputs)
    logits = torch.randn(3, VOCAB, device=device)
    masked = apply_grammar_masks(logits, [None, grammar, None])
    allowed = set(torch.isfinite(masked[1]).nonzero().flatten().tolist())
    assert allowed == can_start
    assert torch.equal(masked[1][list(allowed)], logits[1][list(allowed)])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # rows without a grammar untouched

    outputs.append(tokenizer.convert_tokens_to_ids("a"))  # the grammar follows the outputs
    masked = apply_grammar_masks(logits, [grammar])
    assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == can_start | {EOS}
    assert not grammar.is_complete and grammar.error is None


def allowed_by_hand(texts: list[str], written: str, choices: list[str]) -> set[int]:
    """The tokens that keep the text a prefix of a choice, written out. (Once a single choice is
    left, llguidance forces its rest: only that rest's canonical tokens are allowed.)"""
    return {
        t
        for t, text in enumerate(texts)
        if t != EOS and text and any(c.startswith(written + text) for c in choices)
    }


def test_masks_of_a_choice_are_the_prefixes_of_its_strings(tokenizer, grammars):
    choices = ["cab", "Rome", "Lisbon"]
    texts = token_texts(tokenizer)
    for target in choices:
        outputs: list[int] = []
        grammar = grammars.matcher(StructuredOutput(choice=choices), outputs)
        written = ""
        while written != target:
            row = apply_grammar_masks(torch.zeros(1, VOCAB), [grammar])[0]
            allowed = set(torch.isfinite(row).nonzero().flatten().tolist())
            by_hand = allowed_by_hand(texts, written, choices)
            left = [c for c in choices if c.startswith(written)]
            if len(left) > 1:
                assert allowed == by_hand, written
                step = min(t for t in by_hand if target.startswith(written + texts[t]))
            else:  # the rest is forced: its canonical tokens
                step = tokenizer.encode(target[len(written) :])[0]
                assert step in allowed and allowed <= by_hand, written
            outputs.append(step)
            written += texts[step]
        grammar.follow()
        assert grammar.is_complete


def reference_choice(checkpoint, tokenizer, prompt: list[int], choices: list[str]) -> list[int]:
    """Greedy decoding with transformers' model, masked by hand to the tokens that keep the
    text a prefix of one of the choices until one choice is left, then that choice's rest in
    its canonical tokens."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    texts = token_texts(tokenizer)
    tokens, written = [], ""
    while len(left := [c for c in choices if c.startswith(written)]) > 1:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
        best = max(allowed_by_hand(texts, written, choices), key=lambda t: float(logits[t]))
        tokens.append(best)
        written += texts[best]
    return tokens + tokenizer.encode(left[0][len(written) :])


def test_greedy_choice_matches_a_hand_masked_transformers_loop(llm, checkpoint, tokenizer):
    choices = ["cabbage", "London", "quick fox"]
    for seed in range(3):
        prompt = torch.randint(1, VOCAB, (12,), generator=torch.Generator().manual_seed(seed))
        prompt = prompt.tolist()
        params = SamplingParams(
            temperature=0, max_tokens=30, structured_output=StructuredOutput(choice=choices)
        )
        (output,) = llm.generate([prompt], params)
        completion = output.outputs[0]
        assert completion.token_ids == reference_choice(checkpoint, tokenizer, prompt, choices)
        assert completion.text in choices and completion.finish_reason == "stop"
    assert llm.core.kv_manager.num_used_blocks == 0


def test_a_grammar_after_a_token_leaves_the_output_free_until_it(llm, checkpoint, tokenizer):
    """`structured_output_after` (a reasoning model's end of reasoning): greedy, the output is
    the free output up to that token, then the hand-masked transformers loop's choice from
    there; a plain request in the same batch samples as it does alone."""
    choices = ["cabbage", "London", "quick fox"]
    prompt = [7, 70, 170, 270, 370, 470]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (free,) = llm.generate([prompt], plain)
    free_ids = free.outputs[0].token_ids
    cut = next(i for i in range(1, len(free_ids)) if free_ids[i] not in free_ids[:i])
    after = free_ids[cut]
    gated = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_output=StructuredOutput(choice=choices),
        structured_output_after=after,
    )
    outputs = llm.generate([prompt, prompt], [gated, plain])
    expected = free_ids[: cut + 1]
    expected += reference_choice(checkpoint, tokenizer, prompt + expected, choices)
    assert outputs[0].outputs[0].token_ids == expected
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert tokenizer.decode(expected[cut + 1 :]) in choices
    assert outputs[1].outputs[0].token_ids == free_ids
    assert llm.core.kv_manager.num_used_blocks == 0


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["ok", "level", "count"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_follow_their_schema_or_regex(llm, temperature):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [300, 200, 100, 50, 25]]
    json_params = SamplingParams(
        temperature=temperature,
        seed=1,
        max_tokens=60,
        structured_output=StructuredOutput(SCHEMA, disable_any_whitespace=True),
    )
    regex_params = json_params.with_updates(
        structured_output=StructuredOutput(regex=r"[0-9]{3}-(ab|ba){1,3}\.")
    )
    plain = SamplingParams(temperature=temperature, seed=1, max_tokens=8)
    outputs = llm.generate(prompts * 3, [json_params] * 3 + [regex_params] * 3 + [plain] * 3)
    for output in outputs[:3]:
        answer = json.loads(output.outputs[0].text)
        assert set(answer) == {"ok", "level", "count"} and isinstance(answer["ok"], bool)
        assert answer["level"] in ("low", "high") and 0 <= answer["count"] <= 9
        assert output.outputs[0].finish_reason == "stop"
    for output in outputs[3:6]:
        assert re.fullmatch(r"[0-9]{3}-(ab|ba){1,3}\.", output.outputs[0].text)
        assert output.outputs[0].finish_reason == "stop"
    # a request without a grammar beside them samples as it does alone
    alone = llm.generate(prompts, plain)
    assert [o.outputs[0].token_ids for o in outputs[6:]] == [o.outputs[0].token_ids for o in alone]
    assert llm.core.kv_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"regex": "("}, "the regex for structured outputs is not valid"),
        ({"json": {"type": "nonsense"}}, "the json for structured outputs is not valid"),
        ({"json": False}, "Unsatisfiable schema: schema is false"),  # a schema, not none
        ({"json": "{not json"}, "the JSON schema is not valid JSON"),
        ({"choice": []}, "choice must be a list of non-empty strings"),
        ({"grammar": "start: ??"}, "the grammar for structured outputs is not valid"),
    ],
)
def test_unusable_constraints_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**fields)


@pytest.mark.parametrize(
    "fields",
    [{"regex": r"[^\x00-\U0010FFFF]"}, {"grammar": "start: A\nA: /[^\\x00-\\U0010FFFF]/"}],
)
def test_a_constraint_no_text_matches_is_refused_as_the_engine_takes_it(grammars, fields):
    """Valid for llguidance's check, but no token can start it: the engine's matcher refuses
    it (the worker's 400) where its first mask would have allowed the end of text alone."""
    with pytest.raises(UnsatisfiableConstraint, match="matches no text this model can write"):
        grammars.matcher(StructuredOutput(**fields), [])
    assert grammars.matcher(StructuredOutput(regex="[ab]+"), []).error is None


def test_a_generate_that_raises_leaves_no_request_in_the_engine(llm):
    """A batch whose second request's constraint matches nothing raises as that request is
    added; the first, already in the engine, is taken out again: the next call answers as the
    same request alone (before, that call met the leftover's outputs and raised KeyError)."""
    prompt, plain = [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6)
    alone = llm.generate([prompt], plain)[0].outputs[0].token_ids
    nothing = plain.with_updates(structured_output=StructuredOutput(regex=r"[^\x00-\U0010FFFF]"))
    with pytest.raises(UnsatisfiableConstraint, match="matches no text this model can write"):
        llm.generate([prompt, [9, 10, 11]], [plain, nothing])
    assert not llm.core.has_work() and llm.core.kv_manager.num_used_blocks == 0
    assert llm.generate([prompt], plain)[0].outputs[0].token_ids == alone
