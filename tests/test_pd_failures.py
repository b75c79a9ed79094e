"""PD failure semantics with real workers on a tiny random checkpoint, each failure injected.

Workers (one set for the module); the prefill workers' faults come from the test-only plug-in
tests/fault_plugins (on their PYTHONPATH, with TANDEM_TEST_KV_FAULT set):

    prefill-delay  fault delay:DELAY_S        its KV server waits DELAY_S before sending
    prefill-drop   fault drop:1               its KV server closes after the first layer;
                   --num-kv-blocks 40         one long leased prompt makes the next one queue
    decode-recompute / decode-fail            --kv-transfer-timeout TRANSFER_TIMEOUT_S, one per
                                              --kv-load-failure-policy
    decode         default timeout            loads succeed (after DELAY_S from prefill-delay);
                                              killed by the last test

Both prefill workers lease for LEASE_S. Every test ends with no block held on any worker it used
(`tandem_kv_cache_blocks_used` and `tandem_kv_blocks_leased` back to 0). Right answers are
checked against the same request served whole (no PD) by a prefill worker.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pd_fixtures import (
    HTTP_TIMEOUT_S,
    Completion,
    assert_nothing_held,
    failures,
    metric,
    prefill_leg,
    prefill_leg_body,
    read_stream,
    run_direct,
    run_pd,
    running_processes,
    running_workers,
    start_faulty_worker,
    token_prompt,
    wait_for_value,
    wait_until,
    with_defaults,
)

CHECKPOINT = "llama-gqa"
DELAY_S = 1.5
LEASE_S = 3.5
TRANSFER_TIMEOUT_S = 0.5
COMPLETIONS = "/v1/completions"
PREFILL_DROP_BLOCKS = 40
HOLD_TIMEOUT_S = LEASE_S + 5  # a lease must be gone by then, even on a loaded machine
DRAINED_S = 5.0


@pytest.fixture(scope="module")
def workers(tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    common = ("--num-kv-blocks", "512")
    lease = ("--kv-lease-timeout", str(LEASE_S))
    timeout = ("--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S))
    specs = {  # name -> (fault, flags)
        "prefill-delay": (f"delay:{DELAY_S}", ("--role", "prefill", *lease, *common)),
        "prefill-drop": (
            "drop:1",
            ("--role", "prefill", *lease, "--num-kv-blocks", str(PREFILL_DROP_BLOCKS)),
        ),
        "decode-recompute": (None, ("--role", "decode", *timeout, *common)),
        "decode-fail": (
            None,
            ("--role", "decode", "--kv-load-failure-policy", "fail", *timeout, *common),
        ),
        "decode": (None, ("--role", "decode", *common)),
    }
    model = str(tiny_checkpoints[CHECKPOINT])
    log_dir = tmp_path_factory.mktemp("pd-failures")
    starts = {
        name: functools.partial(start_faulty_worker, fault, log_dir, *flags, model=model)
        for name, (fault, flags) in specs.items()
    }
    with running_processes(starts) as started:
        yield started


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as http:
        yield http


def request_body(seed: int, length: int = 200, **fields) -> dict:
    body = {"prompt": token_prompt(seed, length, 1, 512), "max_tokens": 8, "temperature": 0.0}
    return with_defaults(dict(body, **fields))


def reference(client, workers, body: dict) -> Completion:
    """The request served whole, without PD, by a prefill worker."""
    return run_direct(client, workers["prefill-drop"].url, COMPLETIONS, dict(body, stream=False))


def decode_leg(client, worker, body: dict, params: dict, **options) -> httpx.Response:
    return client.post(
        worker.url + COMPLETIONS,
        json=dict(body, kv_transfer_params=params),
        timeout=options.get("timeout", HTTP_TIMEOUT_S),
    )


def num_blocks(body: dict) -> int:
    return -(-len(body["prompt"]) // 16)


@pytest.mark.parametrize(
    ("prefill", "kind"), [("prefill-delay", "timeout"), ("prefill-drop", "connection")]
)
def test_failed_load_is_recomputed_with_recompute_policy(client, workers, prefill, kind):
    decode = workers["decode-recompute"]
    body = request_body(1)
    before = failures(decode, kind)
    answer = run_pd(client, workers[prefill].url, decode.url, COMPLETIONS, body)
    assert answer == reference(client, workers, body)
    wait_until(lambda: failures(decode, kind) == before + 1, 5, f"no {kind} failure counted")
    assert_nothing_held(workers[prefill], decode, timeout=HOLD_TIMEOUT_S)


@pytest.mark.parametrize(
    ("prefill", "kind", "stream"),
    [("prefill-delay", "timeout", True), ("prefill-drop", "connection", False)],
)
def test_failed_load_is_a_clear_error_with_fail_policy(client, workers, prefill, kind, stream):
    decode = workers["decode-fail"]
    body = request_body(2, stream=stream)
    params = prefill_leg(client, workers[prefill].url, COMPLETIONS, body)["kv_transfer_params"]
    before = failures(decode, kind)
    if stream:
        with client.stream(
            "POST", decode.url + COMPLETIONS, json=dict(body, kv_transfer_params=params)
        ) as response:
            assert response.status_code == 200
            chunks = read_stream(response)
        # the first token (known from the prefill) streams, then the error ends the stream
        assert chunks[0]["choices"][0]["token_ids"] == [params["first_token_id"]]
        error = chunks[-1]["error"]
    else:
        response = decode_leg(client, decode, body, params)
        assert response.status_code == 500
        error = response.json()["error"]
    assert error["message"] == f"the KV transfer from the prefill worker failed ({kind})"
    assert failures(decode, kind) == before + 1
    assert_nothing_held(workers[prefill], decode, timeout=HOLD_TIMEOUT_S)


def test_unusable_params_fail_before_any_transfer(client, workers):
    """A layout that is not the decode worker's: a 400 naming it before any block is allocated.
    An unknown transfer id: recomputed, or a clear error."""
    prefill = workers["prefill-drop"]
    body = request_body(3)
    params = prefill_leg(client, prefill.url, COMPLETIONS, body)["kv_transfer_params"]
    wrong_layout = dict(params, kv_layout="2x2x9x16:float32")
    for decode in ("decode-recompute", "decode-fail"):
        refused = decode_leg(client, workers[decode], body, wrong_layout)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "kv_transfer_params.kv_layout"
    unknown_id = dict(params, remote_request_id="no-such-transfer")
    expected = reference(client, workers, body)
    recomputed = decode_leg(client, workers["decode-recompute"], body, unknown_id)
    assert Completion.from_response(recomputed.json()) == expected
    failed = decode_leg(client, workers["decode-fail"], body, unknown_id)
    assert failed.status_code == 500 and "(not_found)" in failed.json()["error"]["message"]
    missing_first_token = {k: v for k, v in params.items() if k != "first_token_id"}
    refused = decode_leg(client, workers["decode"], body, missing_first_token)
    assert refused.status_code == 400 and "first_token_id" in refused.json()["error"]["message"]
    # no decode leg took the lease over: it is released, as the router does on a refusal
    release = {"remote_request_id": params["remote_request_id"]}
    assert client.post(prefill.url + "/v1/kv/release", json=release).status_code == 200
    assert_nothing_held(
        prefill, workers["decode-recompute"], workers["decode-fail"], timeout=HOLD_TIMEOUT_S
    )


def test_lease_expires_without_a_decode(client, workers):
    prefill, decode = workers["prefill-drop"], workers["decode-recompute"]
    body = request_body(4, length=300)
    answer = prefill_leg(client, prefill.url, COMPLETIONS, body)
    leased_at = time.monotonic()
    assert len(answer["kv_transfer_params"]["remote_block_ids"]) == num_blocks(body) == 19
    wait_for_value(prefill, "tandem_kv_blocks_leased", 19, timeout=2)
    assert metric(prefill, "tandem_kv_cache_blocks_used") == 19
    assert_nothing_held(prefill, timeout=HOLD_TIMEOUT_S)
    assert time.monotonic() - leased_at > LEASE_S - 0.5
    # a decode leg that comes too late finds nothing and recomputes
    before = failures(decode, "not_found")
    late = decode_leg(client, decode, body, answer["kv_transfer_params"])
    assert Completion.from_response(late.json()) == reference(client, workers, body)
    assert failures(decode, "not_found") == before + 1


def test_release_frees_the_lease_at_once(client, workers):
    prefill = workers["prefill-delay"]
    body = request_body(5)
    params = prefill_leg(client, prefill.url, COMPLETIONS, body)["kv_transfer_params"]
    wait_for_value(prefill, "tandem_kv_blocks_leased", num_blocks(body), timeout=2)
    unknown = client.post(prefill.url + "/v1/kv/release", json={"remote_request_id": "nobody"})
    assert unknown.status_code == 404  # never handed out
    assert metric(prefill, "tandem_kv_blocks_leased") == num_blocks(body)
    released_at = time.monotonic()
    release = {"remote_request_id": params["remote_request_id"]}
    response = client.post(prefill.url + "/v1/kv/release", json=release)
    assert response.status_code == 200
    assert response.json() == {"released": params["remote_request_id"]}
    assert_nothing_held(prefill, timeout=LEASE_S)
    assert time.monotonic() - released_at < LEASE_S - 1
    missing = client.post(prefill.url + "/v1/kv/release", json={})
    assert missing.status_code == 400


def test_decode_keeps_decoding_while_a_request_waits_for_its_kv(client, workers):
    """The decode worker's running requests go on while another waits for its KV."""
    prefill, decode = workers["prefill-delay"], workers["decode"]
    pd_body = request_body(6)
    params = prefill_leg(client, prefill.url, COMPLETIONS, pd_body)["kv_transfer_params"]
    finished: list[str] = []

    def pd_decode_leg() -> Completion:
        response = decode_leg(client, decode, pd_body, params)
        finished.append("pd")
        return Completion.from_response(response.json())

    with ThreadPoolExecutor(1) as pool:
        pd_answer = pool.submit(pd_decode_leg)
        wait_for_value(decode, "tandem_requests_waiting", 1, timeout=DELAY_S)
        plain_body = request_body(7, length=20, max_tokens=24)
        plain = run_direct(client, decode.url, COMPLETIONS, plain_body)
        finished.append("plain")
        assert pd_answer.result() == reference(client, workers, pd_body)
    assert finished == ["plain", "pd"]
    assert plain == reference(client, workers, plain_body)
    assert_nothing_held(prefill, decode, timeout=HOLD_TIMEOUT_S)


def test_decode_abort_while_loading_frees_both_sides(client, workers):
    """The client gives the decode leg up while its KV is on the way: the load still ends and
    confirms (the prefill frees at once, not at lease expiry), then the decode frees too."""
    prefill, decode = workers["prefill-delay"], workers["decode"]
    body = request_body(8)
    sent_before = metric(prefill, "tandem_kv_transfer_blocks_sent")
    params = prefill_leg(client, prefill.url, COMPLETIONS, body)["kv_transfer_params"]
    answered_at = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        decode_leg(client, decode, body, params, timeout=DELAY_S / 3)
    assert_nothing_held(prefill, decode, timeout=HOLD_TIMEOUT_S)
    assert time.monotonic() - answered_at < LEASE_S
    assert metric(prefill, "tandem_kv_transfer_blocks_sent") == sent_before + num_blocks(body)
    assert metric(decode, "tandem_requests_running") == 0
    assert metric(decode, "tandem_requests_waiting") == 0


def test_prefill_abort_while_queued_frees_everything(client, workers):
    """A prefill leg given up while it waits for KV blocks never runs and leaves nothing."""
    prefill = workers["prefill-drop"]  # PREFILL_DROP_BLOCKS blocks
    holder = request_body(9, length=600)  # 38 blocks, kept under lease
    params = prefill_leg(client, prefill.url, COMPLETIONS, holder)["kv_transfer_params"]
    release = {"remote_request_id": params["remote_request_id"]}
    try:
        with pytest.raises(httpx.ReadTimeout):  # 7 more blocks do not fit: this leg waits
            leg = prefill_leg_body(request_body(10))
            client.post(prefill.url + COMPLETIONS, json=leg, timeout=0.5)
        wait_for_value(prefill, "tandem_requests_waiting", 0, timeout=LEASE_S - 1.5)
        assert metric(prefill, "tandem_kv_blocks_leased") == num_blocks(holder) == 38
    finally:
        assert client.post(prefill.url + "/v1/kv/release", json=release).status_code == 200
    assert_nothing_held(prefill, timeout=2)
    assert metric(prefill, "tandem_requests_running") == 0


def test_killed_decode_leaves_the_prefill_healthy_and_empty(client, workers):
    prefill, decode = workers["prefill-delay"], workers["decode"]
    body = request_body(11)
    send_failures = failures(prefill, "send")
    params = prefill_leg(client, prefill.url, COMPLETIONS, body)["kv_transfer_params"]
    outcome: list[BaseException | None] = []

    def doomed_decode_leg() -> None:
        try:
            decode_leg(client, decode, body, params)
            outcome.append(None)
        except httpx.HTTPError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=doomed_decode_leg)
    thread.start()
    wait_for_value(decode, "tandem_requests_waiting", 1, timeout=DELAY_S)
    os.killpg(decode.process.pid, signal.SIGKILL)  # engine core included
    thread.join(timeout=30)
    assert outcome and isinstance(outcome[0], httpx.HTTPError)
    assert_nothing_held(prefill, timeout=HOLD_TIMEOUT_S)
    assert client.get(prefill.url + "/health").json()["status"] == "ok"
    wait_until(lambda: failures(prefill, "send") > send_failures, 5, "no send failure counted")
    after = run_direct(client, prefill.url, COMPLETIONS, body)
    assert after == reference(client, workers, body)


def test_a_draining_prefill_worker_serves_its_leases_first(client, tiny_checkpoints, tmp_path):
    """SIGTERM to a prefill worker that leased a prompt's KV: its HTTP server closes at once,
    but its KV port stays open until the decode collected the lease, and then it exits 0. The
    decode worker fails rather than recompute a load it could not make, and answers as the
    request served whole."""
    specs = {
        "prefill": ("--role", "prefill", "--num-kv-blocks", "64"),
        "decode": ("--role", "decode", "--kv-load-failure-policy", "fail", "--num-kv-blocks", "64"),
    }
    model = str(tiny_checkpoints[CHECKPOINT])
    with running_workers(tmp_path, specs, model) as started:
        prefill, decode = started["prefill"], started["decode"]
        body = request_body(21)
        params = prefill_leg(client, prefill.url, COMPLETIONS, body)["kv_transfer_params"]
        os.killpg(prefill.process.pid, signal.SIGTERM)
        wait_until(lambda: not http_answers(client, prefill.url), 10, "its HTTP server is open")
        time.sleep(DRAINED_S)  # a worker with nothing leased has exited by now
        assert prefill.process.poll() is None, "the lease was not waited for"
        answer = decode_leg(client, decode, body, params)
        assert answer.status_code == 200, answer.text
        assert Completion.from_response(answer.json()) == run_direct(
            client, decode.url, COMPLETIONS, dict(body, stream=False)
        )
        assert prefill.process.wait(timeout=15) == 0, prefill.log_tail()
        assert_nothing_held(decode)


def http_answers(client: httpx.Client, url: str) -> bool:
    try:
        client.get(url + "/health", timeout=2)
    except httpx.HTTPError:
        return False
    return True
