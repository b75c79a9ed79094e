"""What a new user meets first, through the router over fake workers (tests/fake_worker.py,
served in threads by test_router_flow's fixtures): long requests that are not cut, a wedged
worker that still frees its requests, OpenAI errors for unknown routes, the workers' model list,
vLLM's metric names; and `make serve`'s flags.

The fake model echoes the prompt's words: "a b" with max_tokens=3 completes to " a b a".
"""

from __future__ import annotations

import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import test_router_flow
from test_router_flow import HTTP, MODEL, metric_samples, stream, wait_for

make_cluster = test_router_flow.make_cluster  # the fixture, shared

REPO = Path(__file__).resolve().parents[1]
# Health checks every 0.1 s that give up after 0.2 s; a worker whose checks go unanswered for
# READ_TIMEOUT_S is lost. The router's old read timeout cut any leg silent that long.
READ_TIMEOUT_S = 0.5
FAST_HEALTH = {"health_interval_s": 0.1, "health_timeout_s": 0.2, "read_timeout_s": READ_TIMEOUT_S}


def completion(url: str, body: dict) -> tuple[int, dict]:
    response = HTTP.post(url + "/v1/completions", json=body)
    return response.status_code, response.json()


def test_a_request_is_not_cut_while_its_worker_answers_health_checks(make_cluster):
    """A whole answer that takes three times the read timeout (a long generation on CPU, the
    README's first example) comes through, on both legs and on a plain one; a stream whose
    tokens come slower than the read timeout too. The old router answered 504."""
    cluster = make_cluster(both=1, **FAST_HEALTH)
    cluster.decode[0].control.answer_delay_s = 3 * READ_TIMEOUT_S
    status, answer = completion(cluster.url, {"prompt": "a b", "max_tokens": 3})
    assert status == 200, answer
    assert answer["choices"][0]["text"] == " a b a"
    assert cluster.prefill[0].kinds() == ["prefill"] and cluster.decode[0].kinds() == ["decode"]

    cluster.decode[0].control.token_delay_s = 2 * READ_TIMEOUT_S
    payloads = stream(cluster.url, "/v1/completions", {"prompt": "a b", "max_tokens": 3})
    assert "".join(p["choices"][0]["text"] for p in payloads[:-1]) == " a b a"
    assert payloads[-1] == "[DONE]"

    for fake in cluster.prefill + cluster.decode:  # no PD pair left: plain legs to `both`
        fake.control.health_status = 503
    wait_for(lambda: cluster.pool.counts() == {"prefill": 0, "decode": 0, "both": 1})
    cluster.both[0].control.answer_delay_s = 3 * READ_TIMEOUT_S
    status, answer = completion(cluster.url, {"prompt": "c", "max_tokens": 2, "n": 2})
    assert status == 200 and [c["text"] for c in answer["choices"]] == [" c c", " c c"]


def test_a_draining_worker_finishes_its_requests(make_cluster):
    """A worker that closed its port (uvicorn's graceful shutdown) refuses health checks but
    still answers its open connections: its legs are not cut. The read timeout is 2 s here: a
    check sent as the port closes can go unanswered (it times out, or is reset), and with the
    other tests' 0.5 s the leg was once cut with a 504 on a loaded machine; the answer still
    takes four read timeouts."""
    cluster = make_cluster(**{**FAST_HEALTH, "read_timeout_s": 4 * READ_TIMEOUT_S})
    decode = cluster.decode[0]
    decode.control.answer_delay_s = 16 * READ_TIMEOUT_S  # outlasts the waits below
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(completion, cluster.url, {"prompt": "a b", "max_tokens": 3})
        # generous waits: on a loaded machine health rounds and legs come late
        wait_for(lambda: decode.kinds() == ["decode"], timeout=15.0)
        decode.server.server.should_exit = True  # stops listening, finishes what it holds
        wait_for(lambda: not cluster.pool.available(("decode",)), timeout=7.0)
        assert not asked.done()
        status, answer = asked.result()
    assert status == 200 and answer["choices"][0]["text"] == " a b a"


@pytest.mark.parametrize("stage", ["prefill", "decode", "decode streamed"])
def test_a_wedged_worker_frees_its_request_promptly(make_cluster, stage: str):
    """A worker that stops answering (its health checks time out) is lost after the read
    timeout: its leg ends, the upstream connection is closed, and the prefill lease is
    released. A lost decode leg's request ends with a 504 (or an error event once streaming);
    a lost prefill leg's goes whole to the decode worker."""
    cluster = make_cluster(**FAST_HEALTH)
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    wedged = prefill if stage == "prefill" else decode
    wedged.control.health_delay_s = 3.0  # longer than the health timeout
    body = {"prompt": "a b", "max_tokens": 3}
    started = time.monotonic()
    if stage == "decode streamed":
        decode.control.token_delay_s = 30.0
        payloads = stream(cluster.url, "/v1/completions", body)
        assert payloads[0]["choices"][0]["text"] == " a"  # the prefill's first token
        error = payloads[1]["error"]
        assert error["code"] == "worker_lost" and payloads[2] == "[DONE]"
        wait_for(lambda: decode.stats.aborted_streams == 1)
    else:
        wedged.control.prefill_delay_s = wedged.control.answer_delay_s = 30.0
        status, answer = completion(cluster.url, body)
        counter = "aborted_prefills" if stage == "prefill" else "aborted_answers"
        wait_for(lambda: getattr(wedged.stats, counter) == 1)
    elapsed = time.monotonic() - started
    assert READ_TIMEOUT_S <= elapsed < READ_TIMEOUT_S + 2, elapsed
    if stage == "prefill":
        assert status == 200 and answer["choices"][0]["text"] == " a b a", answer
        assert [request["kind"] for request in decode.stats.requests] == ["plain"]
        fallbacks = 'tandem_router_pd_decisions_total{decision="whole",reason="prefill_failed"}'
        assert metric_samples(cluster.url)[fallbacks]
        return
    if stage == "decode":
        assert status == 504 and answer["error"]["code"] == "worker_lost", answer
        error = answer["error"]
    assert wedged.url in error["message"] and "stopped answering" in error["message"]
    assert error.keys() == {"message", "type", "param", "code"}
    wait_for(lambda: prefill.stats.released == prefill.stats.leased)
    samples = metric_samples(cluster.url)
    assert samples['tandem_router_requests_total{endpoint="completions",outcome="upstream_error"}']


def test_unknown_routes_and_methods_get_openai_errors(make_cluster):
    cluster = make_cluster()
    for method, path, status in [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/chat/completions", 404),
        ("DELETE", "/v1/models", 405),
        ("POST", "/health", 405),
        ("GET", "/v1/completions", 405),  # the proxied routes answer it themselves
    ]:
        response = HTTP.request(method, cluster.url + path)
        assert response.status_code == status, (method, path)
        error = response.json()["error"]
        assert error.keys() == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and path in error["message"]
        if status == 405:
            assert response.headers["allow"] in error["message"]


def test_models_are_the_workers_own_entries(make_cluster):
    """/v1/models carries what the workers say of their model: created, max_model_len (one
    worker's entry: each worker's `created` is its own start, a second apart at times)."""
    cluster = make_cluster()
    workers = [*cluster.prefill, *cluster.decode]
    entries = [HTTP.get(worker.url + "/v1/models").json()["data"] for worker in workers]
    assert all({"created", "max_model_len"} <= data[0].keys() for data in entries)
    answer = HTTP.get(cluster.url + "/v1/models").json()
    assert answer["object"] == "list" and answer["data"] in entries


def test_router_metrics_under_vllms_names(make_cluster):
    cluster = make_cluster()
    for _ in range(2):
        stream(cluster.url, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    completion(cluster.url, {"model": MODEL, "prompt": "a", "max_tokens": 2})
    completion(cluster.url, {"model": "nope", "prompt": "a"})  # a 404: not a success
    samples = metric_samples(cluster.url)
    label = f'{{model_name="{MODEL}"}}'
    assert samples[f"vllm:request_success_total{label}"] == 3
    assert samples[f"vllm:e2e_request_latency_seconds_count{label}"] == 3
    assert samples[f"vllm:time_to_first_token_seconds_count{label}"] == 2
    assert not any('model_name="nope"' in name for name in samples)


def test_a_prompt_scored_only_goes_whole_to_one_worker(make_cluster):
    """echo with max_tokens 0 (lm-evaluation-harness's loglikelihood) needs the prompt
    computed where it is answered, and no token: no PD legs."""
    cluster = make_cluster()
    for extra in ({}, {"logprobs": 1}):
        completion(cluster.url, {"prompt": "a b", "max_tokens": 0, "echo": True, **extra})
    assert cluster.prefill[0].stats.requests == []
    assert cluster.decode[0].kinds() == ["plain", "plain"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_serve_passes_flags_from_the_command_line_only():
    def serve_line(*variables: str, env: dict[str, str] | None = None) -> str:
        command = ["make", "-n", "serve", *variables]
        dry_run = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, check=True, env=env
        ).stdout
        return [line for line in dry_run.splitlines() if "tandem serve" in line][-1]

    line = serve_line("PORT=9000", "MODEL=my.gguf", "ARGS=--decode 2 --device cpu")
    assert line.split() == [
        ".venv/bin/tandem", "serve", "--port", "9000", "--model", "my.gguf",
        "--decode", "2", "--device", "cpu",
    ]  # fmt: skip
    environment = {"PATH": "/usr/bin:/bin", "PORT": "5000", "MODEL": "x"}  # someone else's
    assert serve_line(env=environment).split() == [".venv/bin/tandem", "serve"]
