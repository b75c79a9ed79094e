"""Helpers of the PD tests: groups of real workers, and a small client that runs the two legs.

The client runs the legs as docs/protocol.md specifies them:

    prefill leg: the client's body, stream=false, max_tokens=1 (and max_completion_tokens=1 if
                 the client sent it), no stream_options / min_tokens, kv_transfer_params asking
                 for remote decode                  -> answer with a top-level kv_transfer_params
    decode leg:  the client's original body + that kv_transfer_params -> the whole completion

`Completion` reduces a response (collected or streamed) to what must match between a PD pair and
a `both` worker: the token ids, the text, the finish reason and usage.completion_tokens. Every
request asks for `return_token_ids`, so token identity is checked on ids, not on text.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker_fixtures import WorkerProcess, read_metrics, start_tandem, start_worker

HTTP_TIMEOUT_S = 300.0
FAULT_PLUGIN_DIR = Path(__file__).resolve().parent / "fault_plugins"

REMOTE_DECODE_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def running_workers(
    log_dir: Path, specs: dict[str, tuple[str, ...]], model: str
) -> contextlib.AbstractContextManager[dict[str, WorkerProcess]]:
    """Start one worker per name (flags after `--model model`) all at once, wait until every one
    is healthy, and always stop them all afterwards."""
    starts = {
        name: functools.partial(start_worker, log_dir, *flags, model=model)
        for name, flags in specs.items()
    }
    return running_processes(starts)


def start_faulty_worker(fault: str | None, *flags: str, **kwargs) -> WorkerProcess:
    """start_worker, with the test-only KV fault plug-in (tests/fault_plugins) injecting `fault`
    into the worker's KV server (None: no fault)."""
    if fault is None:
        return start_worker(*flags, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_TEST_KV_FAULT", fault)
        paths = [str(FAULT_PLUGIN_DIR), os.environ.get("PYTHONPATH")]
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
        return start_worker(*flags, **kwargs)


def running_routers(
    log_dir: Path, prefill_url: str, decode_url: str, *flags: str
) -> contextlib.AbstractContextManager[dict[str, WorkerProcess]]:
    """tandem routers over one prefill and one decode worker, one per flow: "handoff" (both
    legs at once) and "in sequence" (`--no-handoff`, vLLM's order), started together, each
    with `flags` too."""
    start = functools.partial(
        start_tandem, log_dir, "router", "--prefill", prefill_url, "--decode", decode_url, *flags
    )
    starts = {"handoff": start, "in sequence": functools.partial(start, "--no-handoff")}
    return running_processes(starts)


@contextlib.contextmanager
def running_processes(
    starts: dict[str, Callable[[], WorkerProcess]],
) -> Iterator[dict[str, WorkerProcess]]:
    """Start one process per name (workers or routers) all at once, wait until every one is
    healthy, and always stop those started afterwards."""
    started: dict[str, WorkerProcess] = {}
    try:
        for name, start in starts.items():
            started[name] = start()
        for process in started.values():
            process.wait_healthy()
        yield started
    finally:
        for process in started.values():
            process.stop()


def metric(worker: WorkerProcess | str, name: str) -> float:
    """The value of one metric (summed over its labels); 0 when the worker has not set it yet."""
    url = worker if isinstance(worker, str) else worker.url
    return read_metrics(url).get(name, 0.0)


def failures(worker: WorkerProcess, kind: str) -> float:
    """How many KV transfers of this kind failed on the worker (tandem_kv_transfer_failures)."""
    text = httpx.get(f"{worker.url}/metrics", timeout=10.0).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem_kv_transfer_failures_total" and sample.labels["kind"] == kind
    )


def wait_until(
    predicate: Callable[[], bool], timeout: float, message: Callable[[], str] | str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(message() if callable(message) else message)
        time.sleep(0.1)


def wait_for_value(worker: WorkerProcess | str, name: str, expected: float, timeout: float) -> None:
    """Poll `name` on the worker's /metrics until it equals expected; fail with the last value."""
    last = {"value": None}

    def reached() -> bool:
        last["value"] = metric(worker, name)
        return last["value"] == expected

    wait_until(reached, timeout, lambda: f"{name} is {last['value']}, expected {expected}")


def assert_nothing_held(*workers: WorkerProcess | str, timeout: float = 10.0) -> None:
    """Every worker ends with no KV block held by a request or a lease."""
    for worker in workers:
        wait_for_value(worker, "tandem_kv_cache_blocks_used", 0.0, timeout)
        wait_for_value(worker, "tandem_kv_blocks_leased", 0.0, timeout)


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    completion_tokens: int | None

    @classmethod
    def from_response(cls, response: dict[str, Any]) -> Completion:
        choice = response["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        usage = response.get("usage") or {}
        return cls(
            choice["token_ids"], text, choice["finish_reason"], usage.get("completion_tokens")
        )

    @classmethod
    def from_chunks(cls, chunks: list[dict[str, Any]]) -> Completion:
        token_ids: list[int] = []
        text = ""
        finish_reason = None
        completion_tokens = None
        for chunk in chunks:
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                token_ids += choice.get("token_ids", [])
                text += choice["delta"].get("content", "") if "delta" in choice else choice["text"]
                finish_reason = choice.get("finish_reason") or finish_reason
        return cls(token_ids, text, finish_reason, completion_tokens)


def with_defaults(body: dict[str, Any]) -> dict[str, Any]:
    """Every test request returns token ids and, when streamed, the usage chunk."""
    body = dict(body, return_token_ids=True)
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return body


def read_stream(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE response, checking that it ends with `data: [DONE]`."""
    chunks = []
    done = False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            done = True
        else:
            chunks.append(json.loads(payload))
    assert done, "the stream did not end with [DONE]"
    return chunks


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> Completion:
    """One ordinary request (collected or streamed, as body says); must succeed."""
    if body.get("stream"):
        with client.stream("POST", url, json=body, timeout=HTTP_TIMEOUT_S) as response:
            assert response.status_code == 200, response.read()
            return Completion.from_chunks(read_stream(response))
    response = client.post(url, json=body, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return Completion.from_response(response.json())


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=dict(REMOTE_DECODE_PARAMS))
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


def prefill_leg(client: httpx.Client, prefill_url: str, path: str, body: dict) -> dict[str, Any]:
    response = client.post(prefill_url + path, json=prefill_leg_body(body), timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "kv_transfer_params" in answer, answer
    return answer


def run_pd(
    client: httpx.Client, prefill_url: str, decode_url: str, path: str, body: dict[str, Any]
) -> Completion:
    """Both legs of one PD request; a prefill answer without kv_transfer_params is final."""
    body = with_defaults(body)
    answer = prefill_leg(client, prefill_url, path, body)
    params = answer["kv_transfer_params"]
    if params is None:
        return Completion.from_response(answer)
    return post(client, decode_url + path, dict(body, kv_transfer_params=params))


def run_direct(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> Completion:
    return post(client, url + path, with_defaults(body))


def run_pd_and_direct(
    client: httpx.Client, workers: dict[str, WorkerProcess], path: str, body: dict[str, Any]
) -> tuple[Completion, Completion]:
    """The same request through the PD pair and whole on the `both` worker, at the same time."""
    with ThreadPoolExecutor(1) as pool:
        direct = pool.submit(run_direct, client, workers["both"].url, path, body)
        pd = run_pd(client, workers["prefill"].url, workers["decode"].url, path, body)
        return pd, direct.result()


def token_prompt(seed: int, length: int, low: int, high: int) -> list[int]:
    """A reproducible prompt of `length` token ids in [low, high) (a small LCG, no global RNG)."""
    state = seed * 2654435761 + 12345
    ids = []
    for _ in range(length):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        ids.append(low + (state >> 33) % (high - low))
    return ids


def prompt_set(max_length: int, low: int, high: int) -> list[list[int]]:
    """16 prompts from 5 tokens to max_length (block size 16): one block and many, exact block
    multiples and partial last blocks, and shared prefixes (prompts that extend one base sequence,
    some of them extending a whole earlier prompt), ordered so that later prompts hit the prefix
    cache of earlier ones on every worker. About max_length + 850 distinct tokens in all."""
    base = token_prompt(1, max_length, low, high)
    lengths = [5, 16, 17, 33, 64, 100, 255, 257]
    distinct = [token_prompt(100 + n, n, low, high) for n in lengths]
    shared = [
        base[:300],
        base[:300] + token_prompt(2, 7, low, high),
        base[:300] + token_prompt(3, 40, low, high),
        base[:423],  # extends base[:300]
        base[:200] + token_prompt(4, 60, low, high),
        base[: max_length // 2],
        base[: max_length - 40],
        base[:max_length],  # extends the previous prompt
    ]
    prompts = distinct + shared
    assert len(prompts) == 16 and len({tuple(p) for p in prompts}) == 16
    return prompts
