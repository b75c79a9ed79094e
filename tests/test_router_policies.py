"""Routing policies, prompt hashing, the prefill leg's body and SSE parsing, without servers."""

from __future__ import annotations

import asyncio

from tandem.router.classify import is_single_prompt, prefill_leg_body, wants_one_token
from tandem.router.policies import (
    LeastOutstandingPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    prefix_hashes,
    prompt_units,
)
from tandem.router.relay import iter_sse_data
from tandem.router.workers import Worker


def workers(*outstanding: int) -> list[Worker]:
    return [
        Worker(url=f"http://w{i}", role="prefill", outstanding=n) for i, n in enumerate(outstanding)
    ]


def test_prefix_hashes_chain_over_blocks():
    shared = prefix_hashes("abcdefgh" + "ij", 4)
    other = prefix_hashes("abcdefgh" + "xy", 4)
    assert len(shared) == 3  # two full blocks and the tail
    assert shared[:2] == other[:2] and shared[2] != other[2]
    # The chain makes a block's hash depend on everything before it, not on the block alone.
    assert prefix_hashes("zzzzabcd", 4)[1] != prefix_hashes("abcdabcd", 4)[1]
    assert prefix_hashes((1, 2, 3, 4, 5), 2)[:2] == prefix_hashes((1, 2, 3, 4, 6), 2)[:2]
    assert prefix_hashes(None, 4) == [] and prefix_hashes("", 4) == []
    salted = prefix_hashes("abcdefgh", 4, "tenant a")  # a cache salt starts another chain
    assert salted == prefix_hashes("abcdefgh", 4, "tenant a")
    assert not set(salted) & set(prefix_hashes("abcdefgh", 4) + prefix_hashes("abcdefgh", 4, "b"))


def test_prompt_units_read_completions_and_chat():
    assert prompt_units("completions", {"prompt": "hello"}) == "hello"
    assert prompt_units("completions", {"prompt": ["hello"]}) == "hello"
    assert prompt_units("completions", {"prompt": [5, 6, 7]}) == (5, 6, 7)
    assert prompt_units("completions", {"prompt": ["a", "b"]}) is None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_units("chat", {"messages": messages}) == "system\nbe brief\nuser\nhi\n"
    assert prompt_units("chat", {"messages": "nonsense"}) is None


def test_round_robin_and_least_outstanding():
    pool = workers(0, 0, 0)
    policy = RoundRobinPolicy()
    assert [policy.choose(pool, []).url for _ in range(4)] == [
        "http://w0",
        "http://w1",
        "http://w2",
        "http://w0",
    ]
    least = LeastOutstandingPolicy()
    assert least.choose(workers(3, 1, 2), []).url == "http://w1"
    tied = workers(1, 0, 0)
    assert {least.choose(tied, []).url for _ in range(2)} == {"http://w1", "http://w2"}


def test_prefix_aware_follows_the_cache_until_the_load_is_too_uneven():
    policy = PrefixAwarePolicy(balance_threshold=2)
    pool = workers(0, 0)
    long_prefix = prefix_hashes("s" * 64 + "question one", 16)
    first = policy.choose(pool, long_prefix)
    again = prefix_hashes("s" * 64 + "question two", 16)
    assert policy.choose(pool, again) is first
    fresh = prefix_hashes("t" * 80, 16)
    assert policy.choose(pool, fresh) is not first  # no match: the other, least loaded worker

    first.outstanding = 2  # 2 above the other: still within the threshold
    assert policy.choose(pool, again) is first
    first.outstanding = 3  # 3 above: the least loaded worker takes it
    assert policy.choose(pool, again) is not first


def test_the_prefill_leg_follows_the_protocol():
    body = {
        "prompt": "p",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "temperature": 0.5,
    }
    leg = prefill_leg_body(body)
    assert leg == {
        "prompt": "p",
        "stream": False,
        # the client's limits: the prefill worker checks them, then samples one token
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "temperature": 0.5,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert body["stream"] is True  # the client's body is untouched
    assert "max_completion_tokens" not in prefill_leg_body({"prompt": "p"})


def test_which_requests_take_which_path():
    assert wants_one_token("completions", {"max_tokens": 1})
    assert wants_one_token("chat", {"max_tokens": 9, "max_completion_tokens": 1})
    assert not wants_one_token("chat", {"max_tokens": 1, "max_completion_tokens": 9})
    # the workers read max_completion_tokens first on completions too
    assert not wants_one_token("completions", {"max_tokens": 1, "max_completion_tokens": 5})
    assert not wants_one_token("completions", {})
    assert is_single_prompt("completions", {"prompt": "x"})
    assert is_single_prompt("completions", {"prompt": [1, 2]})
    assert is_single_prompt("completions", {"prompt": [[1, 2]]})
    assert not is_single_prompt("completions", {"prompt": ["x", "y"]})
    assert not is_single_prompt("chat", {"messages": [], "n": 2})
    assert not is_single_prompt("completions", {"prompt": "x", "best_of": 3})


def test_sse_events_are_split_however_the_bytes_arrive():
    stream = (
        b'data: {"a": 1}\r\n\r\n: comment\n\ndata: line one\ndata: line two\n\ndata: [DONE]\n\n'
    )

    async def collect(chunk_size: int) -> list[bytes]:
        async def chunks():
            for start in range(0, len(stream), chunk_size):
                yield stream[start : start + chunk_size]

        return [payload async for payload in iter_sse_data(chunks())]

    expected = [b'{"a": 1}', b"line one\nline two", b"[DONE]"]
    for chunk_size in (1, 3, 7, len(stream)):
        assert asyncio.run(collect(chunk_size)) == expected


def handoff_proxy(prefill_policy: str, endpoints: dict[str, dict | None]):
    """A proxy over workers whose health checks passed with these /health `kv` objects."""
    from tandem.router.config import RouterConfig
    from tandem.router.metrics import RouterMetrics
    from tandem.router.proxy import Proxy
    from tandem.router.workers import WorkerPool

    prefill = [url for url in endpoints if "prefill" in url]
    decode = [url for url in endpoints if "decode" in url]
    config = RouterConfig(
        prefill_urls=tuple(prefill), decode_urls=tuple(decode), prefill_policy=prefill_policy
    )
    metrics = RouterMetrics()
    pool = WorkerPool(config, metrics)
    for worker in pool._workers.values():
        worker.healthy = True
        worker.kv_endpoint = endpoints[worker.url]
    return Proxy(config, pool, metrics)


def stream_context():
    from tandem.router.dispatch import RequestContext

    return RequestContext("completions", {"prompt": "hi", "stream": True}, "id", True)


TCP_PREFILL = {"transport": "tcp", "handoff": True, "host": "127.0.0.1", "port": 9000}


def test_the_handoff_prefill_worker_follows_the_prefill_policy():
    endpoints = {
        "http://prefill-a": TCP_PREFILL,
        "http://prefill-b": TCP_PREFILL,
        "http://decode-a": {"transport": "tcp", "handoff": True},
    }
    proxy = handoff_proxy("round-robin", endpoints)
    chosen = [proxy.flows.handoff_worker(stream_context(), []).url for _ in range(4)]
    assert chosen == ["http://prefill-a", "http://prefill-b"] * 2


def test_no_handoff_unless_every_prefill_worker_has_a_decode_worker_on_its_transport():
    endpoints = {
        "http://prefill-a": TCP_PREFILL,
        "http://decode-a": {"transport": "cuda-ipc", "handoff": True},
        "http://decode-b": None,  # a worker whose /health says nothing about KV (vLLM's)
    }
    assert (
        handoff_proxy("round-robin", endpoints).flows.handoff_worker(stream_context(), []) is None
    )
    endpoints["http://decode-c"] = {"transport": "tcp", "handoff": True}
    endpoints["http://prefill-b"] = None
    assert (
        handoff_proxy("round-robin", endpoints).flows.handoff_worker(stream_context(), []) is None
    )


def test_the_prompt_is_hashed_only_when_the_prefill_policy_has_a_choice():
    from tandem.router.dispatch import RequestContext

    body = {"prompt": list(range(300)), "stream": True}
    ctx = RequestContext("completions", body, "id", True)
    endpoints = {"http://prefill-a": TCP_PREFILL, "http://decode-a": TCP_PREFILL}
    assert handoff_proxy("prefix-aware", endpoints).flows.prefill_prefix(ctx) == []
    endpoints["http://prefill-b"] = TCP_PREFILL
    proxy = handoff_proxy("prefix-aware", endpoints)
    expected = prefix_hashes(tuple(range(300)), proxy.config.prefix_block_chars)
    assert len(expected) > 1 and proxy.flows.prefill_prefix(ctx) == expected
    assert handoff_proxy("least-outstanding", endpoints).flows.prefill_prefix(ctx) == []
