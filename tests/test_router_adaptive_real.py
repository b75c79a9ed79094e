"""The planner moves a real `--role auto` worker between duties under load, and back.

A prefill worker and two auto workers (KV over tcp) behind a router; the auto workers start on
decode duty, so every request is prefilled on the prefill worker and decoded on an auto worker.
Waves of prompts fill the prefill worker's queue (a small step budget keeps the prompt tokens
waiting for many steps) past `--planner-prefill-queue-high`, and the planner moves one auto
worker onto prefill; two more waves go out at once then, within `--planner-dwell-s`, so some of
their prompts are prefilled on the moved worker and their KV moves from it to the other auto
worker. Once the load is served the prefill side stays idle for the idle time, and the planner
moves it back. The thresholds and the health round are the router's own flags.

The move rests on the prefill side falling behind, not on a colocated pool's streams slowing:
that rule also asks the workers' measured decode step to predict the split pays, which on a
loaded CPU depends on what they happened to measure first (its cases are in
test_router_adaptive.py, with load reports given).

Checked: the router counts both moves and ends with both auto workers on decode; an auto
worker sent KV (it prefilled); every request answered with the tokens a colocated worker gives
it; and no block stays held on any worker.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pd_fixtures import (
    assert_nothing_held,
    metric,
    run_direct,
    running_processes,
    running_workers,
    token_prompt,
    wait_until,
)
from worker_fixtures import read_metrics, start_tandem

CHECKPOINT = "llama-gqa"
MAX_TOKENS = 6
STEP_TOKENS = 48  # each worker's step budget: a burst's prompts wait many steps
WAVE = 8  # requests sent at once until the planner moves a worker, and twice once it has
MOVE_TIMEOUT_S = 90.0  # waves go out until then (a loaded machine serves them slowly)
ENGINE = ("--num-kv-blocks", "1024", "--max-num-batched-tokens", str(STEP_TOKENS))


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("adaptive-real")
    auto = ("--role", "auto", "--kv-transport", "tcp", *ENGINE)
    specs = {
        "prefill": ("--role", "prefill", "--kv-transport", "tcp", *ENGINE),
        "auto-a": auto,
        "auto-b": auto,
        "both": ("--role", "both", *ENGINE),
    }
    with running_workers(log_dir, specs, str(tiny_checkpoints[CHECKPOINT])) as workers:
        router = functools.partial(
            start_tandem,
            log_dir,
            "router",
            "--prefill",
            workers["prefill"].url,
            "--auto",
            workers["auto-a"].url,
            workers["auto-b"].url,
            "--health-interval",
            "0.2",
            "--planner-prefill-queue-high",
            str(2 * STEP_TOKENS),
            "--planner-prefill-queue-low",  # at most the high mark (a colocated pool's rule)
            str(STEP_TOKENS),
            "--planner-dwell-s",
            "2",
            "--planner-idle-s",
            "2",
        )
        with running_processes({"router": router}) as routers:
            yield dict(workers, router=routers["router"])


def duties(router_url: str) -> dict[str, str | None]:
    """The router's status: each auto worker's duty now."""
    listed = httpx.get(f"{router_url}/internal/workers", timeout=10.0).json()["workers"]
    return {worker["url"]: worker["assigned"] for worker in listed if worker["role"] == "auto"}


def role_changes(router_url: str, duty: str) -> float:
    return read_metrics(router_url).get(f'tandem_router_role_changes_total{{duty="{duty}"}}', 0.0)


def request_body(n: int) -> dict:
    """The n-th request: a distinct prompt of 100 to 348 tokens, every other one streamed (the
    handoff flow once PD)."""
    prompt = token_prompt(300 + n, 100 + 8 * (n % 32), 1, 512)
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": n % 2 == 1}


def test_the_planner_moves_an_auto_worker_to_prefill_and_back_losing_nothing(cluster):
    router = cluster["router"].url
    autos = [cluster["auto-a"], cluster["auto-b"]]
    assert set(duties(router).values()) == {"decode"}
    assert role_changes(router, "prefill") == 0
    limits = httpx.Limits(max_connections=2 * WAVE, max_keepalive_connections=2 * WAVE)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(2 * WAVE) as pool:
        bodies, sent = [], []

        def send_wave() -> None:
            for _ in range(WAVE):
                bodies.append(request_body(len(bodies)))
                sent.append(pool.submit(run_direct, client, router, "/v1/completions", bodies[-1]))

        send_wave()
        deadline = time.monotonic() + MOVE_TIMEOUT_S
        while role_changes(router, "prefill") < 1:
            assert time.monotonic() < deadline, "the planner moved no worker under the load"
            if all(answer.done() for answer in sent):
                send_wave()
            time.sleep(0.02)
        send_wave()  # within the dwell: the moved worker prefills some of these
        send_wave()
        routed = [answer.result() for answer in sent]
        wait_until(
            lambda: (
                role_changes(router, "decode") >= 1 and set(duties(router).values()) == {"decode"}
            ),
            timeout=10.0,
            message=lambda: f"the auto workers did not go back to decode: {duties(router)}",
        )
        assert sum(metric(w, "tandem_kv_transfer_blocks_sent") for w in autos) > 0
        colocated = pool.map(
            lambda body: run_direct(client, cluster["both"].url, "/v1/completions", body), bodies
        )
        for body, got, expected in zip(bodies, routed, colocated, strict=True):
            assert got == expected, f"prompt of {len(body['prompt'])} tokens"
            assert len(expected.token_ids) == MAX_TOKENS
    assert_nothing_held(cluster["prefill"], *autos)
