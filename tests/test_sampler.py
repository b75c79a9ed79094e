"""The sampler against independent references: argmax, hand-made allowed sets for top-k/top-p/
min-p, softmax(logits / T) frequencies, log_softmax in float64 for logprobs, seeded rows that
do not depend on the rest of the batch, and penalties and logit_bias written out token by token
(repetition also against transformers' own logits processor)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from tandem.engine.outputs import ScheduledRequest
from tandem.engine.sampling_params import SamplingParams
from tandem.executor.sampler import Sampler

EOS = 3


def scheduled(params: SamplingParams, output_index: int = 0, request_id: str = "r"):
    return ScheduledRequest(request_id, [1], 0, [0], True, params, output_index)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    return torch.device(request.param)


def sample(logits: torch.Tensor, rows: list[ScheduledRequest], device: torch.device, seed=0):
    return Sampler([EOS], seed)(logits.to(device, torch.float32), rows).result()


def random_logits(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draws(
    logits_row: list[float], params: SamplingParams, count: int, device: torch.device
) -> np.ndarray:
    """`count` unseeded draws from one logits row (one batch of identical rows)."""
    logits = torch.tensor([logits_row]).repeat(count, 1)
    rows = [scheduled(params, request_id=str(i)) for i in range(count)]
    return np.array(sample(logits, rows, device)[0])


def allowed_by_nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p."""
    order = np.argsort(-probs)
    mass = np.cumsum(probs[order])
    return set(order[: int(np.searchsorted(mass, top_p)) + 1].tolist())


def softmax(values: np.ndarray) -> np.ndarray:
    shifted = np.exp(values - values.max())
    return shifted / shifted.sum()


def test_greedy_is_argmax(device):
    logits = random_logits(16, 300, seed=1)
    rows = [scheduled(SamplingParams(temperature=0, top_k=5, top_p=0.5), i) for i in range(16)]
    token_ids, logprobs = sample(logits, rows, device)
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 16


def test_greedy_rows_stay_argmax_in_a_sampled_batch(device):
    logits = random_logits(12, 300, seed=2)
    params = [SamplingParams(temperature=0) if i % 3 == 0 else SamplingParams() for i in range(12)]
    token_ids, _ = sample(logits, [scheduled(p) for p in params], device)
    argmax = logits.argmax(dim=-1).tolist()
    assert [token_ids[i] for i in range(0, 12, 3)] == [argmax[i] for i in range(0, 12, 3)]


def test_top_k_one_equals_greedy(device):
    logits = random_logits(32, 300, seed=3)
    rows = [scheduled(SamplingParams(temperature=1.5, top_k=1)) for _ in range(32)]
    assert sample(logits, rows, device)[0] == logits.argmax(dim=-1).tolist()


def test_seeded_rows_ignore_the_rest_of_the_batch(device):
    vocab = 200
    target_logits = torch.zeros(vocab)  # flat: the token is decided by the noise alone
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = [
        sample(target_logits[None], [scheduled(target, index)], device)[0][0] for index in range(20)
    ]
    assert len(set(alone)) > 10  # each output index draws fresh noise

    others = random_logits(8, vocab, seed=4)
    other_params = [
        SamplingParams(temperature=t, seed=s, top_p=p)
        for t, s, p in [(0.5, 1, 1.0), (1.3, None, 0.9), (0, None, 1.0), (2.0, 99, 0.5)] * 2
    ]
    for index in range(20):
        for position in (0, 3, 8):
            rows = [scheduled(p, index, f"o{i}") for i, p in enumerate(other_params)]
            rows.insert(position, scheduled(target, index, "target"))
            logits = torch.cat([others[:position], target_logits[None], others[position:]])
            for sampler_seed in (0, 7):
                token_ids, _ = sample(logits, rows, device, seed=sampler_seed)
                assert token_ids[position] == alone[index]


def test_top_k_never_picks_outside_the_k_best(device):
    logits = [0.5, 2.0, -1.0, 1.5, 0.0, 1.9, -3.0, 1.0]
    picked = draws(logits, SamplingParams(top_k=3), 3000, device)
    assert set(picked.tolist()) == {1, 5, 3}


@pytest.mark.parametrize(("top_p", "temperature"), [(0.7, 1.0), (0.5, 1.0), (0.9, 0.6), (0.3, 2.0)])
def test_top_p_never_picks_outside_the_nucleus(top_p, temperature, device):
    probs = np.array([0.05, 0.35, 0.02, 0.15, 0.25, 0.005, 0.1, 0.04, 0.03, 0.005])
    logits = np.log(probs)
    allowed = allowed_by_nucleus(softmax(logits / temperature), top_p)
    picked = draws(
        logits.tolist(), SamplingParams(temperature=temperature, top_p=top_p), 4000, device
    )
    assert set(picked.tolist()) == allowed


@pytest.mark.parametrize("min_p", [0.2, 0.5, 0.05])
def test_min_p_never_picks_below_the_threshold(min_p, device):
    probs = np.array([0.05, 0.35, 0.02, 0.15, 0.25, 0.005, 0.1, 0.04, 0.03, 0.005])
    allowed = {i for i, p in enumerate(probs) if p >= min_p * probs.max()}
    picked = draws(np.log(probs).tolist(), SamplingParams(min_p=min_p), 4000, device)
    assert set(picked.tolist()) == allowed


def test_masks_combine(device):
    probs = np.array([0.05, 0.35, 0.02, 0.15, 0.25, 0.005, 0.1, 0.04, 0.03, 0.005])
    # top_k=4 keeps {1, 4, 3, 6}; renormalized they are .41, .29, .18, .12: top_p=0.8 keeps
    # {1, 4, 3}; min_p=0.5 of .41 then drops 3.
    params = SamplingParams(top_k=4, top_p=0.8, min_p=0.5)
    assert set(draws(np.log(probs).tolist(), params, 3000, device).tolist()) == {1, 4}


def test_masked_rows_leave_unmasked_rows_alone(device):
    probs = np.array([0.05, 0.35, 0.02, 0.15, 0.25, 0.005, 0.1, 0.04, 0.03, 0.005])
    count = 3000
    logits = torch.tensor(np.log(probs), dtype=torch.float32)[None].repeat(2 * count, 1)
    rows = [scheduled(SamplingParams(top_k=2 if i % 2 else 0)) for i in range(2 * count)]
    token_ids = np.array(sample(logits, rows, device)[0])
    assert set(token_ids[1::2].tolist()) == {1, 4}
    assert set(token_ids[0::2].tolist()) == set(range(10))


def chi_square(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_frequencies_follow_the_tempered_softmax(temperature, device):
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, 1.2])
    count = 20000
    picked = draws(logits.tolist(), SamplingParams(temperature=temperature), count, device)
    observed = np.bincount(picked, minlength=len(logits)).astype(float)
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001 for a correct sampler.
    assert chi_square(observed, softmax(logits / temperature)) < 20.5
    # A wrong temperature (T applied twice, or not at all) is far outside that.
    wrong = softmax(logits / (temperature * temperature if temperature != 1.0 else 0.5))
    assert chi_square(observed, wrong) > 100


def test_frequencies_inside_the_nucleus_are_renormalized(device):
    probs = np.array([0.05, 0.35, 0.02, 0.15, 0.25, 0.005, 0.1, 0.04, 0.03, 0.005])
    picked = draws(np.log(probs).tolist(), SamplingParams(top_p=0.7), 20000, device)
    observed = np.bincount(picked, minlength=10)[[1, 4, 3]].astype(float)
    assert observed.sum() == 20000
    assert chi_square(observed, probs[[1, 4, 3]] / probs[[1, 4, 3]].sum()) < 13.8  # 2 dof, p=.001


def test_logprobs_are_the_raw_log_softmax(device):
    vocab = 50
    logits = random_logits(5, vocab, seed=5)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.5, logprobs=3, top_k=4),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, logprobs=20, min_p=0.3),
    ]
    token_ids, logprobs = sample(logits, [scheduled(p) for p in params], device)
    assert logprobs[3] is None
    for row, p in enumerate(params):
        if p.logprobs is None:
            continue
        values = logits[row].double().numpy()
        reference = values - values.max() - math.log(np.exp(values - values.max()).sum())
        result = logprobs[row]
        assert result.token_id == token_ids[row]
        assert result.logprob == pytest.approx(reference[token_ids[row]], abs=1e-5)
        assert len(result.top) == p.logprobs
        top_ids = [token_id for token_id, _ in result.top]
        top_values = [value for _, value in result.top]
        assert top_values == sorted(top_values, reverse=True)
        assert top_ids == np.argsort(-reference)[: p.logprobs].tolist()
        assert top_values == pytest.approx(reference[top_ids].tolist(), abs=1e-5)


def test_min_tokens_suppresses_eos_and_stop_ids(device):
    stop_id = 7
    logits = torch.full((1, 20), -1.0)
    logits[0, EOS] = 10.0
    logits[0, stop_id] = 9.0
    logits[0, 12] = 1.0
    greedy = SamplingParams(temperature=0, min_tokens=2, max_tokens=8, stop_token_ids=[stop_id])
    assert sample(logits, [scheduled(greedy, output_index=0)], device)[0] == [12]
    assert sample(logits, [scheduled(greedy, output_index=1)], device)[0] == [12]
    assert sample(logits, [scheduled(greedy, output_index=2)], device)[0] == [EOS]
    # With ignore_eos the EOS token is an ordinary token; the stop id stays banned.
    ignoring = greedy.with_updates(ignore_eos=True)
    assert sample(logits, [scheduled(ignoring, output_index=0)], device)[0] == [EOS]
    # Sampled rows never draw a banned token either, and the logprobs stay raw.
    sampled = SamplingParams(temperature=3.0, min_tokens=1, stop_token_ids=[stop_id], logprobs=1)
    count = 2000
    token_ids, logprobs = sample(
        logits.repeat(count, 1), [scheduled(sampled, 0, str(i)) for i in range(count)], device
    )
    assert not {EOS, stop_id} & set(token_ids)
    assert logprobs[0].top[0][0] == EOS


def with_history(params: SamplingParams, prompt: list[int], outputs: list[int], request_id="r"):
    return ScheduledRequest(request_id, [1], 0, [0], True, params, len(outputs), prompt, outputs)


def penalized_by_hand(
    logits_row: np.ndarray, params: SamplingParams, prompt: list[int], outputs: list[int]
) -> np.ndarray:
    """logit_bias, then OpenAI's presence/frequency and the HF repetition penalty, one token at
    a time in float64."""
    values = logits_row.astype(np.float64)
    for token_id, bias in params.logit_bias.items():
        values[token_id] += bias
    for token_id in set(prompt) | set(outputs):
        if values[token_id] > 0:
            values[token_id] /= params.repetition_penalty
        else:
            values[token_id] *= params.repetition_penalty
    for token_id, count in Counter(outputs).items():
        values[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return values


def random_history(logits_row: torch.Tensor, rng: np.random.Generator) -> tuple[list, list]:
    """A prompt and outputs that repeat some of the row's likeliest tokens (so that penalties
    change the argmax) among random ones."""
    likely = logits_row.topk(4).indices.tolist()
    prompt = rng.integers(0, logits_row.numel(), rng.integers(1, 30)).tolist()
    outputs = rng.integers(0, logits_row.numel(), rng.integers(0, 12)).tolist()
    outputs += rng.choice(likely, rng.integers(0, 6)).tolist()
    prompt += rng.choice(likely, rng.integers(0, 3)).tolist()
    return prompt, outputs


def test_penalties_and_logit_bias_move_the_argmax_as_written_out(device):
    rng = np.random.default_rng(11)
    logits = random_logits(48, 300, seed=11)
    rows, expected = [], []
    for i in range(48):
        params = SamplingParams(
            temperature=0,
            presence_penalty=float(rng.uniform(-2, 2)) if i % 4 else 0.0,
            frequency_penalty=float(rng.uniform(-2, 2)) if i % 3 else 0.0,
            repetition_penalty=float(rng.uniform(0.5, 2.0)) if i % 2 else 1.0,
            logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, 300, 3)},
        )
        prompt, outputs = random_history(logits[i], rng)
        rows.append(with_history(params, prompt, outputs, str(i)))
        expected.append(int(penalized_by_hand(logits[i].numpy(), params, prompt, outputs).argmax()))
    token_ids, _ = sample(logits, rows, device)
    assert token_ids == expected
    moved = sum(e != a for e, a in zip(expected, logits.argmax(dim=-1).tolist(), strict=True))
    assert moved >= 12  # the check can fail: a quarter of the rows move off the raw argmax


def test_repetition_penalty_matches_transformers(device):
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(12)
    logits = random_logits(16, 300, seed=12)
    rows, expected = [], []
    for i in range(16):
        penalty = float(rng.uniform(1.1, 3.0)) if i % 2 else float(rng.uniform(0.3, 0.9))
        prompt, outputs = random_history(logits[i], rng)
        rows.append(with_history(SamplingParams(temperature=0, repetition_penalty=penalty),
                                 prompt, outputs, str(i)))  # fmt: skip
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        scores = processor(torch.tensor([prompt + outputs]), logits[i : i + 1].clone())
        expected.append(int(scores.argmax()))
    assert sample(logits, rows, device)[0] == expected
    assert expected != logits.argmax(dim=-1).tolist()


def test_logit_bias_limits_sampled_rows_and_logprobs_stay_raw(device):
    logits = random_logits(1, 50, seed=13)
    allowed = [3, 17, 41]
    bias = {t: -100.0 for t in range(50) if t not in allowed} | {41: 2.0}
    params = SamplingParams(temperature=1.0, logit_bias=bias, logprobs=0)
    count = 3000
    rows = [with_history(params, [1], [], str(i)) for i in range(count)]
    token_ids, logprobs = sample(logits.repeat(count, 1), rows, device)
    assert set(token_ids) == set(allowed)
    biased = logits[0, allowed].double() + torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64)
    expected = torch.softmax(biased, dim=-1).numpy()
    frequencies = np.array([token_ids.count(t) for t in allowed]) / count
    assert frequencies == pytest.approx(expected, abs=0.04)
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    assert logprobs[0].logprob == pytest.approx(float(raw[token_ids[0]]), abs=1e-5)


def test_rows_without_penalties_are_left_alone(device):
    logits = random_logits(8, 300, seed=14)
    penalized = SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    plain = SamplingParams(temperature=0)
    argmax = logits.argmax(dim=-1).tolist()
    rows = [
        with_history(penalized if i % 2 else plain, [argmax[i]], [argmax[i]] * 3, str(i))
        for i in range(8)
    ]
    token_ids, _ = sample(logits, rows, device)
    assert [token_ids[i] for i in range(0, 8, 2)] == [argmax[i] for i in range(0, 8, 2)]
    assert all(token_ids[i] != argmax[i] for i in range(1, 8, 2))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
    ],
)
def test_out_of_range_penalties_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
