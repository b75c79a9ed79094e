"""The handoff flow: the decode leg goes out with the prefill leg and waits for the prefill's
announcement. Token identity with a `both` worker (driving the legs directly, in either order,
and through the router), the first token ending the request at prefill, and a decode leg given
up while it waits."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pd_fixtures import (
    REMOTE_DECODE_PARAMS,
    Completion,
    assert_nothing_held,
    metric,
    post,
    prompt_set,
    run_direct,
    running_routers,
    running_workers,
    wait_until,
    with_defaults,
)

CHECKPOINT = "llama-gqa"
VOCAB = (1, 512)
PROMPTS = prompt_set(1000, *VOCAB)[::3]
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "seed": 5},
    "penalized": {"temperature": 0.0, "frequency_penalty": -1.0, "repetition_penalty": 0.7},
}
PATH = "/v1/completions"


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    specs = {
        "prefill": ("--role", "prefill", "--num-kv-blocks", "512"),
        "decode": ("--role", "decode", "--num-kv-blocks", "512"),
        "both": ("--role", "both", "--num-kv-blocks", "512"),
    }
    log_dir = tmp_path_factory.mktemp("pd-handoff")
    model = str(tiny_checkpoints[CHECKPOINT])
    with (
        running_workers(log_dir, specs, model) as workers,
        running_routers(log_dir, workers["prefill"].url, workers["decode"].url) as routers,
    ):
        yield dict(workers, router=routers["handoff"], in_sequence=routers["in sequence"])


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as http:
        yield http


def kv_endpoint(client: httpx.Client, worker) -> dict:
    return client.get(f"{worker.url}/health").json()["kv"]


def handoff_legs(client, cluster, body: dict, decode_first: bool) -> tuple[Completion, dict]:
    """Both legs of a handoff, the decode leg sent first (it waits) or last (the announcement
    waits); the completion the decode leg gave, and the prefill leg's answer."""
    body = with_defaults(body)
    handoff_id = uuid.uuid4().hex
    endpoint = kv_endpoint(client, cluster["prefill"])
    prefill_body = {k: v for k, v in body.items() if k not in ("stream_options",)}
    prefill_body.update(
        stream=False,
        max_tokens=1,
        kv_transfer_params=dict(REMOTE_DECODE_PARAMS, handoff_id=handoff_id),
    )
    decode_params = {
        "do_remote_prefill": True,
        "handoff_id": handoff_id,
        "remote_host": endpoint["host"],
        "remote_port": endpoint["port"],
        "kv_transport": endpoint["transport"],
    }
    decode_body = dict(body, kv_transfer_params=decode_params)

    def prefill() -> dict:
        response = client.post(cluster["prefill"].url + PATH, json=prefill_body)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(1) as pool:
        if decode_first:
            decoding = pool.submit(post, client, cluster["decode"].url + PATH, decode_body)
            time.sleep(0.3)  # the decode worker is waiting before the prefill starts
            answer = prefill()
            return decoding.result(), answer
        answer = prefill()
        time.sleep(0.3)  # the announcement is there before the decode leg
        return post(client, cluster["decode"].url + PATH, decode_body), answer


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "prefill-first"])
@pytest.mark.parametrize("sampling", SAMPLING)
def test_handoff_legs_match_the_both_worker(client, cluster, sampling: str, decode_first: bool):
    for index, prompt in enumerate(PROMPTS):
        body = {"prompt": prompt, "max_tokens": 6, **SAMPLING[sampling], "stream": index % 2 == 0}
        decoded, answer = handoff_legs(client, cluster, body, decode_first)
        assert decoded == run_direct(client, cluster["both"].url, PATH, body), len(prompt)
        assert decoded.token_ids[0] == answer["choices"][0]["token_ids"][0]
    assert_nothing_held(cluster["prefill"], cluster["decode"])


def test_a_stop_token_first_ends_the_waiting_decode_leg(client, cluster):
    prompt = PROMPTS[2]
    greedy = {"prompt": prompt, "temperature": 0.0}
    first = run_direct(client, cluster["both"].url, PATH, dict(greedy, max_tokens=1))
    body = dict(greedy, max_tokens=6, stop_token_ids=first.token_ids, stream=True)
    decoded, answer = handoff_legs(client, cluster, body, decode_first=True)
    assert answer["kv_transfer_params"] is None
    assert decoded.token_ids == first.token_ids and decoded.finish_reason == "stop"
    assert decoded == run_direct(client, cluster["both"].url, PATH, body)
    assert_nothing_held(cluster["prefill"], cluster["decode"])


def test_a_decode_leg_given_up_while_waiting_frees_its_blocks(client, cluster):
    """Nothing is ever announced: the client leaves, the wait is cancelled, blocks come back."""
    endpoint = kv_endpoint(client, cluster["prefill"])
    params = {
        "do_remote_prefill": True,
        "handoff_id": "never-announced",
        "remote_host": endpoint["host"],
        "remote_port": endpoint["port"],
        "kv_transport": endpoint["transport"],
    }
    body = {"prompt": PROMPTS[3], "max_tokens": 4, "stream": True, "kv_transfer_params": params}
    decode = cluster["decode"]
    done = threading.Event()

    def wait() -> None:
        try:
            client.post(decode.url + PATH, json=body, timeout=1.5)
        except httpx.TimeoutException:
            done.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: metric(decode, "tandem_kv_cache_blocks_used") > 0, 10, "no blocks taken")
    waiter.join(10)
    assert done.is_set()  # it was still waiting when the client left
    assert_nothing_held(decode, timeout=5)


@pytest.mark.parametrize("sampling", SAMPLING)
def test_streamed_requests_through_the_router_are_handed_off(client, cluster, sampling: str):
    router = cluster["router"]
    before = metric(router, "tandem_router_handoffs_total")
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 6, **SAMPLING[sampling], "stream": True}
        through_router = post(client, router.url + PATH, with_defaults(body))
        assert through_router == run_direct(client, cluster["both"].url, PATH, body), len(prompt)
    assert metric(router, "tandem_router_handoffs_total") - before == len(PROMPTS)
    collected = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0.0}  # vLLM's flow
    assert post(client, router.url + PATH, with_defaults(collected)) == run_direct(
        client, cluster["both"].url, PATH, collected
    )
    assert metric(router, "tandem_router_handoffs_total") - before == len(PROMPTS)
    assert_nothing_held(cluster["prefill"], cluster["decode"])


def test_a_router_told_no_handoff_sends_the_legs_in_sequence(client, cluster):
    router = cluster["in_sequence"]
    body = {"prompt": PROMPTS[4], "max_tokens": 6, "temperature": 0.0, "stream": True}
    assert post(client, router.url + PATH, with_defaults(body)) == run_direct(
        client, cluster["both"].url, PATH, body
    )
    assert metric(router, "tandem_router_handoffs_total") == 0
    assert metric(router, "tandem_router_requests_total") == 1
