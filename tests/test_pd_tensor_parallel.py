"""PD between prefill and decode workers of different tensor-parallel sizes (CPU, gloo, tcp):
token identity with a colocated TP=1 worker for (prefill TP, decode TP) = (1, 2), (2, 1) and
(2, 2), collected and streamed, with chunked prefill (the prefill workers take 32 tokens a step)
and prefix-cache hits on decode (prompts that extend earlier ones), and nothing held on any
worker afterwards. The reference is a `both` worker at TP=1: no KV moves there, so a head range
read from the wrong rank, or a rank that missed its install, changes the tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pd_fixtures import (
    assert_nothing_held,
    prefill_leg,
    prompt_set,
    run_direct,
    run_pd,
    running_workers,
)

CHECKPOINT = "llama-gqa"  # 2 KV heads: one per rank at TP=2
VOCAB = (1, 512)
PROMPTS = prompt_set(1000, *VOCAB)[:10]  # 5 to 255 tokens, shared prefixes
MAX_TOKENS = 6
CHUNK = ("--max-num-batched-tokens", "32")


@pytest.fixture(scope="module")
def workers(tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    tp2 = ("--tensor-parallel-size", "2")
    specs = {
        "prefill-1": ("--role", "prefill", "--num-kv-blocks", "512", *CHUNK),
        "prefill-2": ("--role", "prefill", "--num-kv-blocks", "512", *CHUNK, *tp2),
        "decode-1": ("--role", "decode", "--num-kv-blocks", "512"),
        "decode-2": ("--role", "decode", "--num-kv-blocks", "512", *tp2),
        "both": ("--role", "both", "--num-kv-blocks", "512"),
    }
    model = str(tiny_checkpoints[CHECKPOINT])
    with running_workers(tmp_path_factory.mktemp("pd-tp"), specs, model) as started:
        yield started


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as http:
        yield http


PAIRS = [(1, 2), (2, 1), (2, 2)]


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
@pytest.mark.parametrize("pair", PAIRS, ids=[f"p{a}-d{b}" for a, b in PAIRS])
def test_token_ids_match_a_colocated_worker(client, workers, pair, stream):
    prefill, decode = workers[f"prefill-{pair[0]}"], workers[f"decode-{pair[1]}"]
    for prompt in PROMPTS[:: 2 if stream else 1]:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream}
        reference = run_direct(client, workers["both"].url, "/v1/completions", body)
        pd = run_pd(client, prefill.url, decode.url, "/v1/completions", body)
        assert pd == reference, f"prompt of {len(prompt)} tokens"
    assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"p{a}-d{b}" for a, b in PAIRS])
def test_params_carry_the_tp_size_and_the_model_layout(client, workers, pair):
    prefill = workers[f"prefill-{pair[0]}"]
    body = {"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0.0}
    answer = prefill_leg(client, prefill.url, "/v1/completions", body)
    params = answer["kv_transfer_params"]
    assert params["tp_size"] == pair[0]
    # 2 layers, key and value, the model's 2 KV heads of 16: whatever the prefill's TP
    assert params["kv_layout"].split("x")[2] == "2", params["kv_layout"]
    release = client.post(
        prefill.url + "/v1/kv/release", json={"remote_request_id": params["remote_request_id"]}
    )
    assert release.status_code < 300, release.text
    assert_nothing_held(prefill)
