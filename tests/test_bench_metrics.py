"""The benchmark's arithmetic and sampling, checked against hand-computed values (no server)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tandem.bench.client import RequestRecord, SseDecoder
from tandem.bench.datasets import DatasetOptions, sample_requests
from tandem.bench.metrics import compute_metrics, parse_goodput, peak_output_rate
from tandem.bench.serve import LoadPoint, arrival_offsets, load_points


def test_sse_decoder_stamps_events_only_when_complete() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b'data: {"a": 1}\n\nda') == ['{"a": 1}']
    assert decoder.feed(b"ta: [DO") == []
    assert decoder.feed(b"NE]\r\n") == []
    assert decoder.feed(b"\r\n: keep-alive comment\n\ndata: x\ndata: y\n\n") == ["[DONE]", "x\ny"]


def recorded_requests() -> list[RequestRecord]:
    """Four requests with hand-picked timestamps (seconds); see the expected values below."""
    return [
        # A: ttft 100 ms, ttst 150, itl 50 and 100, e2el 300, tpot (300 - 100) / 2 = 100.
        RequestRecord(0, 10.0, 10.3, [10.1, 10.15, 10.25], True, prompt_tokens=5, output_tokens=3),
        # B: ttft 200, ttst 300, itl 100, e2el 400 (usage and [DONE] came late), tpot 200.
        RequestRecord(1, 10.2, 10.6, [10.4, 10.5], True, prompt_tokens=7, output_tokens=2),
        # C failed: counted, but in no latency and no token total.
        RequestRecord(2, 10.3, 10.35, [10.32], False, "HTTP 500", prompt_tokens=9, output_tokens=9),
        # D: one token at 1200 ms: no ttst, no itl, no tpot.
        RequestRecord(3, 10.0, 11.2, [11.2], True, prompt_tokens=3, output_tokens=1),
    ]


def test_metrics_match_hand_computed_values() -> None:
    result = compute_metrics(recorded_requests(), duration=2.0, percentiles=(90, 99))
    expected = {
        "completed": 3,
        "failed": 1,
        "total_input_tokens": 15,
        "total_output_tokens": 6,
        "request_throughput": 1.5,
        "request_goodput": None,
        "output_throughput": 3.0,
        "total_token_throughput": 10.5,
        # ttft: 100, 200, 1200
        "mean_ttft_ms": 500.0,
        "median_ttft_ms": 200.0,
        "std_ttft_ms": math.sqrt((400**2 + 300**2 + 700**2) / 3),
        "p90_ttft_ms": 200.0 + 0.8 * 1000.0,
        "p99_ttft_ms": 200.0 + 0.98 * 1000.0,
        # ttst: 150, 300
        "mean_ttst_ms": 225.0,
        "median_ttst_ms": 225.0,
        "p99_ttst_ms": 150.0 + 0.99 * 150.0,
        # itl, pooled: 50, 100, 100
        "mean_itl_ms": 250.0 / 3,
        "median_itl_ms": 100.0,
        "std_itl_ms": math.sqrt(((50 - 250 / 3) ** 2 + 2 * (100 - 250 / 3) ** 2) / 3),
        "p90_itl_ms": 100.0,
        # tpot: 100, 200
        "mean_tpot_ms": 150.0,
        "median_tpot_ms": 150.0,
        "std_tpot_ms": 50.0,
        "p90_tpot_ms": 190.0,
        # e2el: 300, 400, 1200
        "mean_e2el_ms": 1900.0 / 3,
        "median_e2el_ms": 400.0,
        "p99_e2el_ms": 400.0 + 0.98 * 800.0,
        # Second 0 after the first start holds 5 content chunks and 3 live requests.
        "max_output_tokens_per_s": 5.0,
        "max_concurrent_requests": 3,
    }
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-9), key


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = recorded_requests()
    # ttft <= 250 and tpot <= 150: A only (B's tpot is 200, D's ttft 1200), 1 of the 4 sent.
    result = compute_metrics(records, 2.0, goodput_slos_ms={"ttft": 250, "tpot": 150})
    assert result["request_goodput"] == pytest.approx(0.5)
    assert result["slo_attainment"] == pytest.approx(0.25)
    assert compute_metrics(records, 2.0)["slo_attainment"] is None
    # tpot <= 150 alone: A, and D whose single token counts as tpot 0.
    assert compute_metrics(records, 2.0, goodput_slos_ms={"tpot": 150})[
        "request_goodput"
    ] == pytest.approx(1.0)
    assert compute_metrics(records, 4.0, goodput_slos_ms={"e2el": 350})[
        "request_goodput"
    ] == pytest.approx(0.25)
    assert parse_goodput(["ttft:200", "e2el:1.5"]) == {"ttft": 200.0, "e2el": 1.5}
    for bad in (["ttft"], ["itl:5"], ["tpot:-1"], ["ttft:fast"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_all_failed_gives_null_latencies_not_zeros() -> None:
    failed = [RequestRecord(0, 1.0, 2.0, [], False, "timeout")]
    result = compute_metrics(failed, 1.0)
    assert result["completed"] == 0 and result["failed"] == 1
    assert result["mean_ttft_ms"] is None and result["p99_itl_ms"] is None
    assert peak_output_rate(failed) == (0.0, 0)


def test_arrival_offsets_have_the_requested_rate_and_burstiness() -> None:
    rng = np.random.default_rng(0)
    assert arrival_offsets(4, math.inf, 1.0, rng) == [0.0] * 4
    assert arrival_offsets(4, 2.0, math.inf, rng) == [0.0, 0.5, 1.0, 1.5]
    for burstiness, expected_cv in ((0.25, 2.0), (1.0, 1.0), (4.0, 0.5)):
        offsets = arrival_offsets(2001, 10.0, burstiness, np.random.default_rng(1))
        gaps = np.diff(offsets)
        assert offsets[0] == 0.0 and offsets[-1] == pytest.approx(200.0)
        assert (gaps >= 0).all()
        assert np.std(gaps) / np.mean(gaps) == pytest.approx(expected_cv, rel=0.15)
    same_seed = [arrival_offsets(5, 3.0, 1.0, np.random.default_rng(9)) for _ in range(2)]
    assert same_seed[0] == same_seed[1]


def test_load_points_sweep_one_flag() -> None:
    assert load_points("inf", "1,8") == (
        "max_concurrency",
        [LoadPoint(math.inf, 1), LoadPoint(math.inf, 8)],
    )
    assert load_points("1,inf", None) == ("request_rate", [LoadPoint(1.0), LoadPoint(math.inf)])
    assert load_points("2", "4") == (None, [LoadPoint(2.0, 4)])
    assert LoadPoint(math.inf, 8).tag == "infqps-concurrency8"
    assert LoadPoint(2.5).tag == "2.5qps"
    for rate, concurrency in (("1,2", "1,2"), ("0", None), ("inf", "0")):
        with pytest.raises(ValueError):
            load_points(rate, concurrency)


def test_random_dataset_token_ids() -> None:
    options = DatasetOptions(
        num_prompts=50,
        seed=3,
        random_input_len=40,
        random_output_len=10,
        random_range_ratio=0.25,
        random_prefix_len=5,
        random_vocab_min=100,
        random_vocab_max=200,
    )
    samples = sample_requests(options, None)
    assert samples == sample_requests(options, None)
    assert len(samples) == 50
    prefixes = {tuple(sample.prompt[:5]) for sample in samples}
    assert len(prefixes) == 1
    for sample in samples:
        assert isinstance(sample.prompt, list)
        assert sample.prompt_len == len(sample.prompt)
        assert 5 + 30 <= sample.prompt_len <= 5 + 50
        assert 7 <= sample.expected_output_len <= 13
        assert all(100 <= token_id < 200 for token_id in sample.prompt)
    assert len({sample.prompt_len for sample in samples}) > 5
    exact = sample_requests(DatasetOptions(num_prompts=3, random_input_len=8), None)
    assert [sample.prompt_len for sample in exact] == [8, 8, 8]


def test_random_dataset_for_chat_is_text() -> None:
    samples = sample_requests(DatasetOptions(num_prompts=2, chat=True, random_input_len=12), None)
    for sample in samples:
        assert (
            isinstance(sample.prompt, str) and len(sample.prompt.split()) == 12 == sample.prompt_len
        )


class LetterTokenizer:
    """One token per letter a..z: enough to check the text path of the datasets."""

    vocab_size = 26

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(char) - ord("a") for char in text if char.isalpha()]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + token_id) for token_id in token_ids)


def test_tokenizer_turns_ids_into_text_of_the_right_length() -> None:
    options = DatasetOptions(num_prompts=4, random_input_len=30, random_vocab_min=0)
    for sample in sample_requests(options, LetterTokenizer()):
        assert isinstance(sample.prompt, str)
        assert len(LetterTokenizer().encode(sample.prompt)) == sample.prompt_len == 30
    with pytest.raises(ValueError, match="random token ids"):
        sample_requests(DatasetOptions(num_prompts=1), LetterTokenizer())  # ids from 1000 up


def test_prefix_dataset_groups_share_prefixes() -> None:
    options = DatasetOptions(
        dataset_name="prefix",
        num_prompts=10,
        prefix_repetition_prefix_len=20,
        prefix_repetition_suffix_len=6,
        prefix_repetition_num_prefixes=3,
        prefix_repetition_output_len=5,
    )
    samples = sample_requests(options, None)
    groups: dict[tuple[int, ...], int] = {}
    for sample in samples:
        assert sample.prompt_len == len(sample.prompt) == 26
        assert sample.expected_output_len == 5
        groups[tuple(sample.prompt[:20])] = groups.get(tuple(sample.prompt[:20]), 0) + 1
    assert sorted(groups.values()) == [3, 3, 4]
    assert len({tuple(sample.prompt[20:]) for sample in samples}) == 10
    group_of = [tuple(sample.prompt[:20]) for sample in samples]
    switches = sum(earlier != later for earlier, later in itertools.pairwise(group_of))
    assert switches > len(groups) - 1  # shuffled: groups interleave instead of coming in blocks


def test_sharegpt_dataset(tmp_path: Path) -> None:
    def conversation(prompt: str, answer: str) -> dict:
        return {
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
        }

    rows = [
        conversation("x" * 40, "y" * 80),  # 10 prompt tokens, 20 output tokens (chars / 4)
        conversation("hi", "y" * 80),  # prompt too short: skipped
        conversation("x" * 400, "y" * 8),  # 100 prompt tokens, 2 output tokens: too short
        {"conversations": [{"from": "human", "value": "alone"}]},  # no answer: skipped
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    samples = sample_requests(
        DatasetOptions(dataset_name="sharegpt", num_prompts=1, dataset_path=str(path)), None
    )
    assert [(s.prompt, s.prompt_len, s.expected_output_len) for s in samples] == [
        ("x" * 40, 10, 20)
    ]
    fixed = DatasetOptions(
        dataset_name="sharegpt", num_prompts=2, dataset_path=str(path), sharegpt_output_len=7
    )
    assert sorted((s.prompt_len, s.expected_output_len) for s in sample_requests(fixed, None)) == [
        (10, 7),
        (100, 7),
    ]
    with pytest.raises(ValueError, match="only 1 usable"):
        sample_requests(
            DatasetOptions(dataset_name="sharegpt", num_prompts=3, dataset_path=str(path)), None
        )
