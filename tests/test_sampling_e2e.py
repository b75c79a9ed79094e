"""Sampling through the whole offline engine on a tiny random checkpoint: seeded requests are
reproducible whatever else runs beside them, n > 1, logprobs against transformers' own forward,
max_tokens, and every KV block free after each call."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

SHAPE = "llama-gqa"
VOCAB = 512


def random_prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=generator).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(str(tiny_checkpoints[SHAPE]), device="cpu", num_kv_blocks=128, block_size=8)


def assert_all_blocks_free(engine: LLM) -> None:
    assert engine.core.kv_manager.num_used_blocks == 0
    assert not engine.core.scheduler.has_unfinished_requests()


def test_seeded_request_is_the_same_alone_and_in_a_batch(llm, tiny_checkpoints):
    prompt = random_prompts(1, seed=1)[0]
    target = SamplingParams(temperature=0.9, seed=42, max_tokens=12)
    (alone,) = llm.generate([prompt], target)
    tokens = alone.outputs[0].token_ids
    assert len(tokens) == 12

    others = random_prompts(8, seed=2)
    other_params = [
        SamplingParams(temperature=t, seed=s, top_p=p, max_tokens=m)
        for t, s, p, m in [
            (0.5, 1, 1.0, 5),
            (1.3, None, 0.9, 20),
            (0.0, None, 1.0, 3),
            (2.0, 99, 0.5, 16),
            (1.0, 42, 1.0, 12),  # the same seed on another prompt
            (0.9, None, 1.0, 8),
            (0.7, 7, 0.8, 1),
            (1.0, None, 1.0, 30),
        ]
    ]
    for position in (0, 4, 8):
        prompts = others[:position] + [prompt] + others[position:]
        params = other_params[:position] + [target] + other_params[position:]
        outputs = llm.generate(prompts, params)
        assert outputs[position].outputs[0].token_ids == tokens
        assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert_all_blocks_free(llm)

    # Another engine that schedules the prompt in small chunks samples the same tokens.
    chunked = LLM(
        str(tiny_checkpoints[SHAPE]), device="cpu", num_kv_blocks=64, max_num_batched_tokens=5
    )
    (again,) = chunked.generate([prompt], target)
    assert again.outputs[0].token_ids == tokens


def test_unseeded_requests_differ(llm):
    prompt = random_prompts(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, max_tokens=10)
    outputs = llm.generate([prompt] * 4, params)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) > 1
    assert_all_blocks_free(llm)


def test_n_gives_n_outputs_reproducible_with_a_seed(llm):
    prompt = random_prompts(1, seed=4)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10)
    (first,) = llm.generate([prompt], params)
    (second,) = llm.generate([prompt], params)
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    sequences = [o.token_ids for o in first.outputs]
    assert all(len(tokens) == 10 for tokens in sequences)
    assert len({tuple(tokens) for tokens in sequences}) > 1  # each sample draws its own noise
    assert [o.token_ids for o in second.outputs] == sequences
    assert all(o.finish_reason == "length" for o in first.outputs)
    (unseeded,) = llm.generate([prompt], params.with_updates(seed=None))
    assert len(unseeded.outputs) == 4
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_transformers(llm, tiny_checkpoints, temperature):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(1, seed=6)[0]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=6, logprobs=4)
    (output,) = llm.generate([prompt], params)
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6

    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[SHAPE], dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + completion.token_ids])).logits[0]
    expected = torch.log_softmax(logits.double(), dim=-1)[len(prompt) - 1 : -1]
    for step, (token_id, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(float(expected[step, token_id]), abs=1e-3)
        assert len(entry.top) == 4
        top_ids = [t for t, _ in entry.top]
        assert top_ids == expected[step].topk(4).indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(
            expected[step].topk(4).values.tolist(), abs=1e-3
        )
        if temperature == 0:
            assert top_ids[0] == token_id
    assert_all_blocks_free(llm)


def test_max_tokens_and_stop_token_ids_finish(llm):
    prompts = random_prompts(3, seed=7)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7))
    for output in outputs:
        assert len(output.outputs[0].token_ids) == 7
        assert output.outputs[0].finish_reason == "length"
        assert output.outputs[0].logprobs is None
    # Stopping at the greedy continuation's third token ends the request there.
    greedy = outputs[0].outputs[0].token_ids
    stop_id = greedy[2]
    first_use = greedy.index(stop_id)
    (stopped,) = llm.generate(
        [prompts[0]], SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[stop_id])
    )
    assert stopped.outputs[0].token_ids == greedy[: first_use + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", stop_id)
    assert_all_blocks_free(llm)


@pytest.mark.timeout(120)  # without the cap, generate would never return
def test_context_is_capped_by_the_kv_cache(tiny_checkpoints):
    """A request must fit the KV cache alone: otherwise it is preempted and rescheduled forever.
    Two blocks of 8 tokens make a 16-token context."""
    small = LLM(str(tiny_checkpoints[SHAPE]), device="cpu", num_kv_blocks=2, block_size=8)
    assert small.core.max_model_len == 16
    prompt = list(range(10))
    with pytest.raises(ValueError, match="exceeds the context length of 16"):
        small.generate([prompt], SamplingParams(max_tokens=10))
    (fits,) = small.generate([prompt], SamplingParams(temperature=0, max_tokens=6))
    (unbounded,) = small.generate([prompt], SamplingParams(temperature=0, max_tokens=None))
    for output in (fits, unbounded):
        assert len(output.outputs[0].token_ids) == 6
        assert output.outputs[0].finish_reason == "length"
    assert_all_blocks_free(small)


@pytest.mark.parametrize("stop_id", [VOCAB, -1])
def test_stop_token_id_outside_the_vocabulary_is_refused(llm, stop_id):
    """min_tokens bans the stop ids in the logits, so an id outside them must not get that far."""
    params = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[stop_id])
    message = f"stop_token_ids: token id {stop_id} is outside the vocabulary"
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3]], params)
    assert_all_blocks_free(llm)


def test_a_refused_prompt_starts_none_of_its_batch(llm):
    good = SamplingParams(temperature=0, max_tokens=3)
    bad = SamplingParams(max_tokens=3, stop_token_ids=[VOCAB])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 3], [4, 5, 6]], [good, bad])
    assert not llm.core.scheduler.has_unfinished_requests()
    (output,) = llm.generate([[1, 2, 3]], good)
    assert len(output.outputs[0].token_ids) == 3
    assert_all_blocks_free(llm)


def test_greedy_penalties_match_transformers(llm, tiny_checkpoints):
    """Repetition penalty against transformers' generate; presence, frequency and logit_bias
    against a greedy loop over transformers' logits with the penalties written out by hand.
    An unpenalized request shares the batch."""
    from transformers import AutoModelForCausalLM

    from test_sampler import penalized_by_hand

    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[SHAPE], dtype=torch.float32)
    prompts = random_prompts(4, seed=9)
    steps = 10
    greedy = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    # A random model seldom repeats a token, so the first two ask for repeats (penalties < 0).
    params = [
        greedy.with_updates(repetition_penalty=0.7),
        greedy.with_updates(frequency_penalty=-1.0, presence_penalty=-0.5),
        greedy.with_updates(repetition_penalty=1.3, logit_bias={prompts[2][0]: 3.0, 5: -2.0}),
        greedy,
    ]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompts[0]]), max_new_tokens=steps, min_new_tokens=steps,
            do_sample=False, repetition_penalty=0.7, pad_token_id=0,
        )  # fmt: skip
        assert outputs[0] == generated[0, len(prompts[0]) :].tolist()
        for prompt, p, output in zip(prompts[1:], params[1:], outputs[1:], strict=True):
            tokens: list[int] = []
            for _ in range(steps):
                logits = reference(torch.tensor([prompt + tokens])).logits[0, -1].numpy()
                tokens.append(int(penalized_by_hand(logits, p, prompt, tokens).argmax()))
            assert output == tokens
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], greedy)]
    assert all(a != b for a, b in zip(plain, outputs[:3], strict=True))  # the penalties bite
    assert_all_blocks_free(llm)


def test_prompt_logprobs_match_transformers(llm, tiny_checkpoints):
    """Every prompt token's logprob and top-n, against transformers' forward; also for a prompt
    whose prefix is already cached (it is computed again) and in small chunks."""
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(1, seed=8)[0] + random_prompts(1, seed=9)[0]
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[SHAPE], dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits.double(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    chunked = LLM(
        str(tiny_checkpoints[SHAPE]), device="cpu", num_kv_blocks=64, max_num_batched_tokens=7
    )
    llm.generate([prompt[:20]], SamplingParams(temperature=0, max_tokens=1))  # cache a prefix
    for engine in (llm, chunked):
        (output,) = engine.generate([prompt], params)
        entries = output.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            row = expected[position - 1]
            assert entry.token_id == prompt[position]
            assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-3)
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
            assert entry.rank == int((row > row[prompt[position]]).sum()) + 1
        assert_all_blocks_free(engine)
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    assert plain.prompt_logprobs is None
