"""Conditional disaggregation with real workers on a tiny random checkpoint.

A router in `--disaggregation conditional` mode over a prefill worker and an auto worker (role
auto: its KV server and client both on; the planner keeps it on decode duty here, as nothing
loads the prefill side) serves a mixed load: short prompts whole on the auto worker, long ones
disaggregated, with follow-ups that extend earlier prompts. Every answer must match, token for
token, the same request on a colocated (`both`) worker, and no KV block may stay held.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pd_fixtures import (
    assert_nothing_held,
    prompt_set,
    run_direct,
    running_processes,
    running_workers,
)
from worker_fixtures import read_metrics, start_tandem

CHECKPOINT = "llama-gqa"
MAX_TOKENS = 6
LOCAL_PREFILL_TOKENS = 64
PROMPTS = prompt_set(1000, 1, 512)  # 5 to 1000 tokens, shared prefixes among them


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("adaptive-tiny")
    specs = {
        "prefill": ("--role", "prefill", "--kv-transport", "tcp", "--num-kv-blocks", "512"),
        "auto": ("--role", "auto", "--kv-transport", "tcp", "--num-kv-blocks", "512"),
        "both": ("--role", "both", "--num-kv-blocks", "512"),
    }
    model = str(tiny_checkpoints[CHECKPOINT])
    with running_workers(log_dir, specs, model) as workers:
        router = functools.partial(
            start_tandem,
            log_dir,
            "router",
            "--prefill",
            workers["prefill"].url,
            "--auto",
            workers["auto"].url,
            "--disaggregation",
            "conditional",
            "--decode-policy",
            "prefix-aware",
            "--max-local-prefill-length",
            str(LOCAL_PREFILL_TOKENS),
        )
        with running_processes({"router": router}) as routers:
            yield dict(workers, router=routers["router"])


def test_a_mixed_load_matches_a_colocated_worker_and_frees_every_block(cluster):
    bodies = [
        {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream}
        for prompt in PROMPTS
        for stream in (False, True)
    ]
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(4) as pool:
        routed = pool.map(
            lambda body: run_direct(client, cluster["router"].url, "/v1/completions", body), bodies
        )
        colocated = [run_direct(client, cluster["both"].url, "/v1/completions", b) for b in bodies]
        for body, got, expected in zip(bodies, list(routed), colocated, strict=True):
            assert got == expected, f"prompt of {len(body['prompt'])} tokens"
            assert len(expected.token_ids) == MAX_TOKENS
    decisions = {
        key: value
        for key, value in read_metrics(cluster["router"].url).items()
        if key.startswith("tandem_router_pd_decisions_total{")
    }
    whole = sum(v for k, v in decisions.items() if 'decision="whole"' in k)
    disaggregated = sum(v for k, v in decisions.items() if 'decision="disaggregated"' in k)
    assert whole > 0 and disaggregated > 0 and whole + disaggregated == len(bodies)
    assert read_metrics(cluster["prefill"].url)["tandem_prompt_tokens_total"] > 0
    assert_nothing_held(cluster["prefill"], cluster["auto"])
