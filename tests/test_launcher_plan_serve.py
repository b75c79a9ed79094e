"""`tandem serve` of a tensor-parallel prefill (TP=2, gloo) and a decode at TP=1 on the CPU, end
to end through its router: token-identical to a colocated TP=1 worker, collected and streamed,
the decode's KV moved from the prefill's two ranks (whose kv_transfer_params say tp_size 2), and
no block held on either worker afterwards."""

from __future__ import annotations

import httpx
import pytest

from pd_fixtures import (
    assert_nothing_held,
    metric,
    prefill_leg,
    prompt_set,
    run_direct,
    wait_until,
)
from tandem.access import CLUSTER_TOKEN_ENV
from worker_fixtures import free_port_block, start_tandem, start_worker

PATH = "/v1/completions"
PROMPTS = prompt_set(1000, 1, 512)[:6]  # 5 to 100 tokens, some extending earlier ones
ENGINE = ("--num-kv-blocks", "256")
CLUSTER_TOKEN = "tp-serve-test-token"  # lets the test send a prefill leg as the router does


@pytest.mark.slow  # about 90 s on a loaded 2-core machine: five processes start
def test_serve_with_a_tp2_prefill_and_a_tp1_decode_matches_a_colocated_worker(
    tiny_checkpoints, tmp_path, monkeypatch
):
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, CLUSTER_TOKEN)
    model = str(tiny_checkpoints["llama-gqa"])  # 2 KV heads: one per prefill rank
    reference = start_worker(tmp_path, "--role", "both", *ENGINE, model=model)
    worker_ports, kv_ports = free_port_block(2), free_port_block(2)
    serve = start_tandem(
        tmp_path, "serve", "--model", model, "--device", "cpu", "--prefill-tp", "2", *ENGINE,
        "--worker-port-base", str(worker_ports), "--kv-port-base", str(kv_ports),
    )  # fmt: skip
    prefill, decode = (f"http://127.0.0.1:{port}" for port in (worker_ports, worker_ports + 1))
    try:
        reference.wait_healthy()
        serve.wait_healthy()
        served = {"prefill": 1, "decode": 1, "both": 0}
        counts = lambda: httpx.get(serve.url + "/health").json()["workers"]  # noqa: E731
        wait_until(lambda: counts() == served, 120, lambda: f"the router counts {counts()}")
        with httpx.Client() as client:
            for index, prompt in enumerate(PROMPTS):
                body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0}
                body["stream"] = index % 2 == 1
                expected = run_direct(client, reference.url, PATH, body)
                assert run_direct(client, serve.url, PATH, body) == expected, len(prompt)
            assert metric(decode, "tandem_kv_transfer_blocks_received") > 0  # PD, not whole
            body = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0.0}
            client.headers["authorization"] = f"Bearer {CLUSTER_TOKEN}"
            params = prefill_leg(client, prefill, PATH, body)["kv_transfer_params"]
            assert params["tp_size"] == 2
            release = {"remote_request_id": params["remote_request_id"]}
            assert client.post(prefill + "/v1/kv/release", json=release).status_code < 300
        assert_nothing_held(prefill, decode)
    finally:
        serve.stop()
        reference.stop()
