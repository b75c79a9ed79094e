"""PD on a tiny random checkpoint: token identity with a `both` worker, 32 concurrent requests
on a decode worker short of KV blocks, and the first token ending the request at prefill. The
workers' API processes never load torch (the checkpoint has no tokenizer, whose transformers
classes would; on two cores torch's import is 2 to 3 s of a worker's start).

The decode worker gets only DECODE_KV_BLOCKS blocks, so under concurrency PD requests wait for
blocks before their load can start; every request must still load its KV exactly once (its
prefill lease is confirmed, not left to expire) and answer right. It schedules asynchronously
(`--async-scheduling`: each step scheduled while the one before runs), the `both` worker it is
compared with synchronously.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pd_fixtures import (
    assert_nothing_held,
    metric,
    post,
    prefill_leg,
    prompt_set,
    run_direct,
    run_pd,
    run_pd_and_direct,
    running_workers,
    token_prompt,
    wait_until,
    with_defaults,
)

CHECKPOINT = "llama-gqa"
MAX_TOKENS = 8
BLOCK_SIZE = 16
DECODE_KV_BLOCKS = 80
VOCAB = (1, 512)
PROMPTS = prompt_set(1000, *VOCAB)
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "seed": 77},
    # The decode worker penalizes the prefill's first token and the prompt as `both` does.
    "penalized": {"temperature": 0.0, "repetition_penalty": 0.7, "frequency_penalty": -1.0,
                  "presence_penalty": -0.5, "logit_bias": {"7": 2.0}},
}  # fmt: skip


@pytest.fixture(scope="module")
def trio(tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    specs = {
        "prefill": ("--role", "prefill", "--num-kv-blocks", "1024"),
        "decode": (
            "--role",
            "decode",
            "--num-kv-blocks",
            str(DECODE_KV_BLOCKS),
            "--async-scheduling",
        ),
        "both": ("--role", "both", "--num-kv-blocks", "1024"),
    }
    model = str(tiny_checkpoints[CHECKPOINT])
    with running_workers(tmp_path_factory.mktemp("pd-tiny"), specs, model) as workers:
        yield workers


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    with httpx.Client(limits=limits) as http:
        yield http


def completion_body(prompt: list[int], sampling: str, **fields) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, **SAMPLING[sampling], **fields}


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
@pytest.mark.parametrize("sampling", SAMPLING)
def test_token_ids_match_both_worker(client, trio, sampling: str, stream: bool):
    for prompt in PROMPTS:
        body = completion_body(prompt, sampling, stream=stream)
        pd, reference = run_pd_and_direct(client, trio, "/v1/completions", body)
        assert pd == reference, f"prompt of {len(prompt)} tokens"
        assert reference.completion_tokens == MAX_TOKENS == len(reference.token_ids)
    assert_nothing_held(trio["prefill"], trio["decode"])


def test_max_completion_tokens_limits_the_decode_leg(client, trio):
    body = {"prompt": PROMPTS[4], "max_completion_tokens": 5, "temperature": 0.0}
    pd = run_pd(client, trio["prefill"].url, trio["decode"].url, "/v1/completions", body)
    assert pd == run_direct(client, trio["both"].url, "/v1/completions", body)
    assert pd.completion_tokens == 5 and pd.finish_reason == "length"


def test_32_concurrent_requests_are_right_and_free_everything(client, trio):
    prefill, decode, both = trio["prefill"], trio["decode"], trio["both"]
    shared = token_prompt(50, 48, *VOCAB)
    prompts = [
        (shared if i % 3 == 0 else []) + token_prompt(200 + i, 20 + 7 * i, *VOCAB)
        for i in range(32)
    ]
    bodies = [completion_body(p, "greedy" if i % 2 else "seeded") for i, p in enumerate(prompts)]
    references = [run_direct(client, both.url, "/v1/completions", body) for body in bodies]
    counters = [
        (prefill, "tandem_kv_transfer_blocks_sent"),
        (decode, "tandem_kv_transfer_seconds_count"),
        (decode, "tandem_kv_transfer_blocks_received"),
        (prefill, "tandem_kv_transfer_blocks_served_total"),
    ]
    assert_nothing_held(prefill, decode)  # earlier tests' transfers are all counted
    before = [metric(worker, name) for worker, name in counters]

    def pd(body: dict):
        return run_pd(client, prefill.url, decode.url, "/v1/completions", body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(pd, bodies))
    for index, (answer, reference) in enumerate(zip(answers, references, strict=True)):
        assert answer == reference, f"request {index}"
    # every lease is confirmed by its load (none left to expire), every load happened once
    assert_nothing_held(prefill, decode, timeout=10)
    num_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    assert num_blocks > 2 * DECODE_KV_BLOCKS  # so requests did wait for decode blocks

    def deltas() -> list[float]:
        return [metric(w, n) - b for (w, n), b in zip(counters, before, strict=True)]

    # every prompt's blocks staged and one load each; the decode received what the prefill
    # served: the blocks its prefix cache lacked (the shared 48 tokens may be there already)
    def counted() -> bool:
        staged, loads, received, served = deltas()
        return [staged, loads] == [num_blocks, len(prompts)] and received == served > 0

    wait_until(counted, 5, lambda: f"{deltas()}: {num_blocks} blocks, {len(prompts)} loads")
    assert deltas()[2] <= num_blocks
    assert metric(decode, "tandem_kv_transfer_failures_total") == 0


def test_prompt_the_decode_worker_has_cached_whole_still_frees_the_lease(client, trio):
    """A 64-token prompt the decode worker already holds in its prefix cache: nothing needs to
    move, but the decode side still confirms, so the prefill lease ends at once."""
    prompt = token_prompt(7, 64, *VOCAB)
    body = completion_body(prompt, "greedy")
    reference = run_direct(client, trio["both"].url, "/v1/completions", body)
    for _ in range(2):  # the second time, the decode worker's cache holds all 4 blocks
        pd = run_pd(client, trio["prefill"].url, trio["decode"].url, "/v1/completions", body)
        assert pd == reference
        assert_nothing_held(trio["prefill"], trio["decode"], timeout=5)


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_stop_token_as_first_token_ends_at_prefill(client, trio, stream: bool):
    prompt = PROMPTS[6]
    greedy = run_direct(
        client, trio["both"].url, "/v1/completions", completion_body(prompt, "greedy")
    )
    first = greedy.token_ids[0]
    body = completion_body(prompt, "greedy", stop_token_ids=[first], stream=stream)
    answer = prefill_leg(client, trio["prefill"].url, "/v1/completions", with_defaults(body))
    assert answer["kv_transfer_params"] is None
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == first
    assert choice["token_ids"] == [first]
    assert_nothing_held(trio["prefill"], timeout=2)
    pd = run_pd(client, trio["prefill"].url, trio["decode"].url, "/v1/completions", body)
    assert pd == run_direct(client, trio["both"].url, "/v1/completions", body)
    assert pd.finish_reason == "stop" and pd.token_ids == [first]


def test_one_token_request_through_both_legs_frees_the_prefill(client, trio):
    body = with_defaults(completion_body(PROMPTS[5], "greedy", max_tokens=1))
    params = prefill_leg(client, trio["prefill"].url, "/v1/completions", body)["kv_transfer_params"]
    try:
        decoded = post(
            client, trio["decode"].url + "/v1/completions", dict(body, kv_transfer_params=params)
        )
        assert decoded == run_direct(client, trio["both"].url, "/v1/completions", body)
        assert decoded.completion_tokens == 1
        assert_nothing_held(trio["prefill"], trio["decode"], timeout=5)
    finally:  # do not leave the lease to the tests that follow
        release = {"remote_request_id": params["remote_request_id"]}
        client.post(trio["prefill"].url + "/v1/kv/release", json=release)


def test_the_api_processes_never_loaded_torch(trio):
    """Last in the module: after every request above, PD transfers included."""
    for name, worker in trio.items():
        maps = Path(f"/proc/{worker.process.pid}/maps").read_text()
        assert "libtorch" not in maps, f"the {name} worker's API process loaded torch"
