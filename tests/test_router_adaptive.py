"""Adaptive PD in the router: conditional disaggregation, KV-aware decode routing, auto workers.

The decisions are checked twice: as functions of workers' load reports (decide.py, planner.py),
and end to end through the router against fake workers (tests/fake_worker.py) whose /health
carries the load report a test sets. The fake model echoes the prompt's words, so a completion's
text is known in advance whichever flow served it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from fake_worker import FakeControl, create_fake_worker
from tandem.launcher.cluster import ClusterError, parse_cluster
from tandem.launcher.plan import ADAPTIVE_ROUTER_KEYS, expected_router_counts, plan_processes
from tandem.router.app import create_app
from tandem.router.config import RouterConfig
from tandem.router.decide import decide
from tandem.router.metrics import RouterMetrics
from tandem.router.planner import Planner, decode_step_after_split_ms
from tandem.router.policies import PrefixAwarePolicy, PrefixIndex, prefix_hashes
from tandem.router.workers import NO_LOAD, Worker, WorkerLoad, load_of
from test_router_flow import (
    HTTP,
    MODEL,
    Fake,
    ThreadServer,
    completion_text,
    metric_samples,
    stop_all,
    stream,
    wait_for,
)

CONDITIONAL = RouterConfig(
    disaggregation="conditional", max_local_prefill_length=100, max_prefill_queue_tokens=1000
)


def worker(url: str, role: str = "decode", tokens_waiting: int = 0, **load: int) -> Worker:
    return Worker(url=url, role=role, load=WorkerLoad(tokens_waiting=tokens_waiting, **load))


# ---- the decisions, from load reports -----------------------------------------------------


def test_load_reports_are_read_from_health_answers():
    body = b'{"status": "ok", "load": {"tokens_waiting": 70, "kv_blocks_used": 3, '
    body += b'"kv_blocks_total": 12, "requests_running": "many", "requests_waiting": -1, '
    body += b'"tpot_p90_ms": 41}}'
    load = load_of(body)
    assert load == WorkerLoad(
        tokens_waiting=70, kv_blocks_used=3, kv_blocks_total=12, tpot_p90_ms=41
    )
    assert load.kv_usage == 0.25
    assert load_of(b'{"role": "decode"}') is NO_LOAD  # vLLM's workers report none
    assert load_of(b"not json") is NO_LOAD and load_of(b'{"load": [1]}') is NO_LOAD


@pytest.mark.parametrize(
    ("uncached", "prefill_queues", "local_queue", "expected"),
    [
        (100, (0,), 0, ("whole", "short_prompt")),  # at the limit: local
        (101, (0,), 0, ("disaggregated", "long_prompt")),
        (None, (0,), 0, ("disaggregated", "unknown_prompt")),
        # the prefill pool is full (its shortest queue) and the decode worker's queue shorter
        (5000, (1001, 4000), 200, ("whole", "prefill_queue_full")),
        (5000, (1000, 4000), 200, ("disaggregated", "long_prompt")),  # not over the limit
        (5000, (3000,), 3500, ("disaggregated", "long_prompt")),  # decode's queue is longer
        # a short prompt leaves a decode worker whose own queue is full for a shorter one
        (10, (200,), 1001, ("disaggregated", "decode_busy")),
        (10, (2000,), 1500, ("whole", "short_prompt")),
    ],
)
def test_conditional_decision(uncached, prefill_queues, local_queue, expected):
    prefills = [worker(f"http://p{i}", "prefill", q) for i, q in enumerate(prefill_queues)]
    decision = decide(CONDITIONAL, uncached, prefills, worker("http://d", "decode", local_queue))
    assert (decision.name, decision.reason) == expected


def test_prompt_tokens_sent_since_the_last_report_count_as_waiting():
    prefill = worker("http://p", "prefill", tokens_waiting=0)
    decode = worker("http://d", "decode", tokens_waiting=0)
    prefill.prompt_tokens_in_flight = 1001  # sent after its report of 0 was taken
    assert prefill.queued_tokens == 1001
    decision = decide(CONDITIONAL, 5000, [prefill], decode)
    assert (decision.name, decision.reason) == ("whole", "prefill_queue_full")
    decode.prompt_tokens_in_flight = 1500  # the decode worker has more to prefill itself
    assert decide(CONDITIONAL, 5000, [prefill], decode).reason == "long_prompt"
    prefill.load = WorkerLoad(tokens_waiting=1600)  # a report above the router's count
    assert prefill.queued_tokens == 1600
    assert decide(CONDITIONAL, 5000, [prefill], decode).reason == "prefill_queue_full"


@pytest.mark.parametrize(
    ("mark_ms", "tpot_p90_ms", "expected"),
    [
        (50, 49, ("whole", "prefill_queue_full")),  # under the mark: the decode worker prefills
        (50, 50, ("disaggregated", "long_prompt")),  # at it: the prompt waits for prefill
        (0, 400, ("whole", "prefill_queue_full")),  # mark 0: TPOT not read
    ],
)
def test_a_decode_worker_at_the_tpot_mark_takes_no_long_prompt(mark_ms, tpot_p90_ms, expected):
    config = dataclasses.replace(CONDITIONAL, planner_decode_tpot_high_ms=mark_ms)
    decode = worker("http://d", "decode", 200, tpot_p90_ms=tpot_p90_ms)
    decision = decide(config, 5000, [worker("http://p", "prefill", 1001)], decode)
    assert (decision.name, decision.reason) == expected


def planner_config(**changes: Any) -> RouterConfig:
    settings = dict(
        planner_prefill_queue_high=1000,
        planner_prefill_queue_low=100,
        planner_decode_tpot_high_ms=30,
        planner_decode_kv_high=0.8,
        planner_dwell_s=5.0,
        planner_idle_s=5.0,
    )
    return RouterConfig(**(settings | changes))


def duties(workers: list[Worker]) -> list[str]:
    return [w.serving_role for w in workers]


def test_planner_moves_auto_workers_between_prefill_and_decode_as_load_shifts(caplog):
    caplog.set_level("INFO", logger="tandem.router")
    metrics = RouterMetrics()
    planner = Planner(planner_config(), metrics)
    autos = [worker(f"http://a{i}", "auto") for i in range(3)]
    planner.plan(autos, now=0.0)
    assert duties(autos) == ["decode"] * 3  # alone, auto workers are a colocated pool

    # Prompts wait in the decode workers' own queues while their streams' TPOT p90 is over the
    # mark: one of them prefills, the least busy.
    for auto in autos:
        auto.load = WorkerLoad(tokens_waiting=1500, requests_running=4, tpot_p90_ms=40)
    autos[1].load = WorkerLoad(tokens_waiting=1500, requests_running=1, tpot_p90_ms=40)
    planner.plan(autos, now=10.0)
    assert duties(autos) == ["decode", "prefill", "decode"]
    assert caplog.messages == [
        "planner: http://a1 takes up prefill (TPOT p90 40 ms, queue 1500 tokens a worker)"
    ]
    planner.plan(autos, now=12.0)  # within the dwell time: no second change
    assert duties(autos) == ["decode", "prefill", "decode"]
    # The prefill worker falls behind (its mean since the change, 1500 and 3000, over the high
    # mark), and two remain on decode: one more.
    autos[1].load = WorkerLoad(tokens_waiting=3000)
    planner.plan(autos, now=16.0)
    assert duties(autos) == ["prefill", "prefill", "decode"]
    assert caplog.messages[-1] == (
        "planner: http://a0 takes up prefill (prefill side behind: queue 2250 tokens a worker)"
    )
    # Never the last decode worker, however long the prefill queue.
    planner.plan(autos, now=30.0)
    assert duties(autos) == ["prefill", "prefill", "decode"]

    # The decode side runs short of KV cache room: an auto prefill worker goes back to decoding.
    autos[2].load = WorkerLoad(tokens_waiting=0, kv_blocks_used=90, kv_blocks_total=100)
    autos[0].load = WorkerLoad(tokens_waiting=2000)
    planner.plan(autos, now=40.0)
    assert duties(autos) == ["decode", "prefill", "decode"]  # the one with less waiting
    # The prefill worker runs idle: the last auto prefill worker goes back too.
    for auto in autos:
        auto.load = WorkerLoad(tokens_waiting=0, idle_ms=5000)
    planner.plan(autos, now=50.0)
    assert duties(autos) == ["decode"] * 3
    assert caplog.messages[-1] == "planner: http://a1 takes up decode (prefill side idle)"

    samples = metrics.render().decode()
    assert 'tandem_router_role_changes_total{duty="prefill"} 2.0' in samples
    assert 'tandem_router_role_changes_total{duty="decode"} 2.0' in samples
    assert 'tandem_router_auto_worker_duty{duty="decode",worker="http://a0"} 1.0' in samples


def test_planner_splits_a_colocated_pool_only_while_prompts_slow_the_streams():
    """A colocated pool moves a worker to prefill once a worker's TPOT p90 reaches the mark while
    prompts wait; a long queue alone (the streams keep their TPOT), a slow TPOT with no prompt
    waiting (decoding itself is the load), or a mark of 0 moves none."""
    planner = Planner(planner_config(planner_dwell_s=0.0, planner_idle_s=0.0), RouterMetrics())
    autos = [worker(f"http://a{i}", "auto") for i in range(3)]
    for index, auto in enumerate(autos):
        auto.load = WorkerLoad(tokens_waiting=5000, requests_running=3 - index, tpot_p90_ms=12)
    planner.plan(autos, now=0.0)
    assert duties(autos) == ["decode"] * 3
    autos[0].load = WorkerLoad(tokens_waiting=5000, requests_running=3, tpot_p90_ms=29)
    planner.plan(autos, now=1.0)
    assert duties(autos) == ["decode"] * 3  # just under the mark
    for auto in autos:
        auto.load = WorkerLoad(tokens_waiting=99, tpot_p90_ms=45)
    planner.plan(autos, now=2.0)
    assert duties(autos) == ["decode"] * 3  # a queue under the low mark: nothing to move
    for index, auto in enumerate(autos):
        auto.load = WorkerLoad(tokens_waiting=5000, requests_running=3 - index)
    autos[0].load = WorkerLoad(tokens_waiting=5000, requests_running=3, tpot_p90_ms=30)
    never = Planner(
        planner_config(planner_dwell_s=0.0, planner_decode_tpot_high_ms=0), RouterMetrics()
    )
    never.plan(autos, now=3.0)
    assert duties(autos) == ["decode"] * 3  # mark 0: never on latency
    planner.plan(autos, now=3.0)
    assert duties(autos) == ["decode", "decode", "prefill"]  # the one running fewest
    # Going back to decode does not wait for the latency: the prefill worker idles, it goes back.
    for auto in autos:
        auto.load = WorkerLoad(tokens_waiting=0, tpot_p90_ms=45, idle_ms=1)
    planner.plan(autos, now=4.0)
    assert duties(autos) == ["decode"] * 3


@pytest.mark.parametrize(
    ("base_us", "us_per_ktoken", "after_ms", "splits"),
    [
        # each worker's arrivals keep 100k tokens of context per 30 ms of time per token: on one
        # worker 200k per 30 ms, 6.67 tokens a microsecond; its step then settles where
        # step = base + slope x 6.67 x step, step = base / (1 - slope x 6.67)
        # mostly the weights (a large model's few streams): 8 ms / (1 - 0.02 x 6.67) = 9.2 ms
        (8000, 20, 8 * 15 / 13, True),
        # mostly KV reads (a small model's long contexts): 2 ms / (1 - 0.14 x 6.67) = 30 ms, the
        # mark: the streams would last longer, overlap more, and miss
        (2000, 140, 30.0, False),
        # 2 ms / (1 - 0.138 x 6.67) = 25 ms: under the mark, but the streams' p90 would not be
        (2000, 138, 25.0, False),
        (2000, 160, math.inf, False),  # 1 - 0.16 x 6.67 < 0: the steps would grow without end
        (0, 0, 0.0, True),  # no line yet (too few decode steps, or a worker that sends none)
    ],
)
def test_a_colocated_pool_splits_only_where_the_decode_step_left_settles_under_the_mark(
    caplog, base_us, us_per_ktoken, after_ms, splits
):
    """Two workers at the TPOT mark (30 ms) with prompts waiting, each decoding 100k tokens of
    context, a token every 30 ms."""
    caplog.set_level("INFO", logger="tandem.router")
    metrics = RouterMetrics()
    planner = Planner(planner_config(planner_dwell_s=0.0), metrics)
    autos = [worker(f"http://a{i}", "auto") for i in range(2)]
    line = dict(decode_step_base_us=base_us, decode_step_us_per_ktoken=us_per_ktoken)
    for index, auto in enumerate(autos):
        auto.load = WorkerLoad(
            tokens_waiting=5000, tpot_p90_ms=35, requests_running=2 - index,
            decode_context_tokens=100_000, decode_token_interval_us=30_000, **line,
        )  # fmt: skip
    assert decode_step_after_split_ms(autos, autos[1]) == pytest.approx(after_ms)
    planner.plan(autos, now=0.0)
    assert duties(autos) == (["decode", "prefill"] if splits else ["decode", "decode"])
    if after_ms:
        said = "takes up prefill" if splits else "no split"
        assert said in caplog.messages[-1]
        assert caplog.messages[-1].endswith(f"the decode step then {after_ms:.1f} ms)")
    gauge = metrics.registry.get_sample_value("tandem_router_planner_split_decode_step_ms")
    assert gauge == pytest.approx(after_ms)
    if not splits:  # said once while it holds, not every round
        said = len(caplog.messages)
        planner.plan(autos, now=1.0)
        assert len(caplog.messages) == said and duties(autos) == ["decode", "decode"]


def test_a_colocated_pool_waits_to_split_until_its_load_is_known(caplog):
    """Workers that report a line but not yet their context a microsecond (a load's first
    seconds, which read low): no split until they do."""
    caplog.set_level("INFO", logger="tandem.router")
    planner = Planner(planner_config(planner_dwell_s=0.0), RouterMetrics())
    autos = [worker(f"http://a{i}", "auto") for i in range(2)]
    for auto in autos:
        auto.load = WorkerLoad(
            tokens_waiting=5000, tpot_p90_ms=35, decode_step_base_us=8000,
            decode_step_us_per_ktoken=20, decode_context_tokens=0, decode_token_interval_us=0,
        )  # fmt: skip
    assert decode_step_after_split_ms(autos, autos[1]) is None
    planner.plan(autos, now=0.0)
    assert duties(autos) == ["decode", "decode"]
    assert caplog.messages[-1].endswith("the decode step then not known yet)")
    for auto in autos:  # known now, as in the first case above: 9.2 ms
        auto.load = dataclasses.replace(
            auto.load, decode_context_tokens=100_000, decode_token_interval_us=30_000
        )
    planner.plan(autos, now=1.0)
    assert sorted(duties(autos)) == ["decode", "prefill"]


def test_planner_gives_prefill_back_only_after_an_idle_time():
    """A prefill worker's engine stats show an empty queue and nothing running between prompts
    (and during a one-step prefill): it goes back to decoding only once it has had no request in
    flight for the idle time (its idle_ms; 4 s, past the dwell time of 1 s)."""
    planner = Planner(planner_config(planner_dwell_s=1.0, planner_idle_s=4.0), RouterMetrics())
    autos = [worker(f"http://a{i}", "auto", 3000, tpot_p90_ms=40) for i in range(2)]
    planner.plan(autos, now=0.0)
    assert duties(autos) == ["prefill", "decode"]
    for now, idle_ms in ((1.0, 900), (2.0, 0), (3.0, 0), (7.0, 3999)):
        autos[0].load = WorkerLoad(idle_ms=idle_ms)  # 0: a request in flight
        planner.plan(autos, now=now)
    assert duties(autos) == ["prefill", "decode"]
    autos[0].load = WorkerLoad(idle_ms=4000)
    planner.plan(autos, now=7.5)
    assert duties(autos) == ["decode", "decode"]


def test_planner_leaves_dedicated_workers_alone_and_keeps_an_auto_prefill_busy_enough():
    planner = Planner(planner_config(planner_dwell_s=0.0), RouterMetrics())
    prefill = worker("http://p", "prefill", tokens_waiting=5000)
    decode = worker("http://d", "decode")
    auto = worker("http://a", "auto")
    planner.plan([prefill, decode, auto], now=0.0)
    assert duties([prefill, decode, auto]) == ["prefill", "decode", "prefill"]
    # The prefill queue, per prefill worker, stays between the marks: no change either way.
    prefill.load = WorkerLoad(tokens_waiting=600)
    planner.plan([prefill, decode, auto], now=1.0)
    assert auto.serving_role == "prefill" and prefill.role == "prefill"


def test_kv_aware_decode_routing_prefers_the_longest_prefix_within_the_balance():
    index = PrefixIndex()
    policy = PrefixAwarePolicy(balance_threshold=2, index=index)
    pool = [worker("http://d0"), worker("http://d1"), worker("http://d2")]
    chat = prefix_hashes("system: be brief. user: first question", 8)
    index.remember(pool[1], prefix_hashes("system: be brief. user: other", 8))
    index.remember(pool[2], chat)
    follow_up = prefix_hashes("system: be brief. user: first question. assistant: yes", 8)
    assert index.matched_blocks(pool[2], follow_up) == 4
    assert index.matched_blocks(pool[1], follow_up) == 3  # "system: be brief. user: "
    assert policy.choose(pool, follow_up) is pool[2]
    pool[2].outstanding = 3  # too much busier than the idle ones: the next longest match
    assert policy.choose(pool, follow_up) is pool[1]


# ---- through the router, against fake workers -----------------------------------------------


@pytest.fixture
def start_router() -> Iterator[Callable[..., tuple[ThreadServer, dict[str, list[Fake]]]]]:
    servers: list[ThreadServer] = []

    def start(roles: dict[str, int], **settings: Any) -> tuple[ThreadServer, dict[str, list]]:
        fakes: dict[str, list[Fake]] = {}
        for role, count in roles.items():
            for _ in range(count):
                control = FakeControl(load={"tokens_waiting": 0})
                app = create_fake_worker(role, MODEL, control)
                fake = Fake(ThreadServer(app).start(), control, app.state.stats)
                servers.append(fake.server)
                fakes.setdefault(role, []).append(fake)
        urls = {f"{role}_urls": tuple(f.url for f in group) for role, group in fakes.items()}
        settings = dict(health_interval_s=0.05, disaggregation="conditional") | settings
        router = ThreadServer(create_app(RouterConfig(**urls, **settings))).start()
        servers.append(router)
        pool, started = router.app.state.pool, sum(roles.values())
        # every worker in the pool (its first health check answered) before a test reads it
        wait_for(lambda: len(pool.available(("prefill", "decode", "both"))) == started)
        return router, fakes

    yield start
    stop_all(servers)


def words(count: int, first: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(first, first + count))


def echo(prompt: str, max_tokens: int) -> str:
    pieces = prompt.split()
    return "".join(" " + pieces[i % len(pieces)] for i in range(max_tokens))


def ask(router: ThreadServer, prompt: str, max_tokens: int = 4) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    text = completion_text(stream(router.url, "/v1/completions", body))
    assert text == echo(prompt, max_tokens)  # the same answer whichever flow served it
    return text


def decisions(router: ThreadServer) -> dict[str, float]:
    return {
        name.split("{", 1)[1].rstrip("}"): value
        for name, value in metric_samples(router.url).items()
        if name.startswith("tandem_router_pd_decisions_total")
    }


def test_conditional_disaggregation_follows_prompt_length_and_the_prefill_queue(start_router):
    router, fakes = start_router({"prefill": 1, "decode": 1}, max_local_prefill_length=20)
    (prefill,), (decode,) = fakes["prefill"], fakes["decode"]
    short, long = words(10), words(30)  # ~15 and ~45 tokens at four characters a token
    ask(router, short)
    assert prefill.kinds() == [] and decode.kinds() == ["plain"]
    ask(router, long)
    assert prefill.kinds() == ["prefill"] and decode.kinds() == ["plain", "decode"]

    # The prefill queue fills up (its load report): a long prompt is prefilled locally.
    prefill.control.load = {"tokens_waiting": 50_000}
    pool = router.app.state.pool
    wait_for(lambda: pool.available(("prefill",))[0].load.tokens_waiting == 50_000)
    ask(router, words(30, first=100))
    assert prefill.kinds() == ["prefill"] and decode.kinds() == ["plain", "decode", "plain"]
    assert decisions(router) == {
        'decision="whole",reason="short_prompt"': 1.0,
        'decision="disaggregated",reason="long_prompt"': 1.0,
        'decision="whole",reason="prefill_queue_full"': 1.0,
    }


def test_long_prompts_faster_than_load_reports_overflow_once_the_router_sent_enough(
    start_router,
):
    # The load reports say nothing (the fakes send none): the router's own count of prompt
    # tokens it sent and the workers have not prefilled fills the prefill queue.
    prompts = [words(150, first=1000 * i) for i in range(3)]
    sizes = [-(-len(prompt) // 4) for prompt in prompts]  # the router's estimate: 4 chars a token
    router, fakes = start_router(
        {"prefill": 1, "decode": 1},
        max_local_prefill_length=20,
        max_prefill_queue_tokens=sizes[0] + sizes[1] - 1,
    )
    (prefill,), (decode,) = fakes["prefill"], fakes["decode"]
    prefill.control.prefill_delay_s = 1.0
    decode.control.token_delay_s = 0.05
    pool = router.app.state.pool
    prefill_worker, decode_worker = pool.available(("prefill",))[0], pool.available(("decode",))[0]
    threads = [threading.Thread(target=ask, args=(router, prompt, 8)) for prompt in prompts]
    threads[0].start()  # queue 0: disaggregated
    wait_for(lambda: prefill_worker.prompt_tokens_in_flight == sizes[0])
    threads[1].start()  # a queue under the limit: disaggregated
    wait_for(lambda: prefill_worker.prompt_tokens_in_flight == sizes[0] + sizes[1])
    threads[2].start()  # over the limit by the router's count: prefilled on the decode worker
    wait_for(lambda: decode.kinds().count("plain") == 1)
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert sorted(decode.kinds()) == ["decode", "decode", "plain"]
    assert decisions(router) == {
        'decision="disaggregated",reason="long_prompt"': 2.0,
        'decision="whole",reason="prefill_queue_full"': 1.0,
    }
    # every count was taken back: by the prefill answers and the plain stream's first byte
    assert prefill_worker.prompt_tokens_in_flight == decode_worker.prompt_tokens_in_flight == 0


def test_clients_that_leave_mid_prefill_leave_no_prompt_tokens_counted(start_router):
    router, fakes = start_router({"prefill": 1, "decode": 1}, max_local_prefill_length=20)
    (prefill,), (decode,) = fakes["prefill"], fakes["decode"]
    prefill.control.prefill_delay_s = decode.control.token_delay_s = 5.0
    pool = router.app.state.pool
    workers = pool.available(("prefill",)) + pool.available(("decode",))
    bodies = [  # two long prompts (disaggregated, whole and streamed) and a short one (plain)
        {"prompt": words(30), "stream": False},
        {"prompt": words(30, first=500), "stream": True},
        {"prompt": words(3, first=900), "stream": True},
    ]
    for body in bodies:
        with pytest.raises(httpx.ReadTimeout):
            HTTP.post(
                router.url + "/v1/completions",
                json=dict(body, model=MODEL, max_tokens=4),
                timeout=0.3,
            )
    assert prefill.kinds() == ["prefill", "prefill"] and decode.kinds().count("plain") == 1
    # taken back as each leg ends: the prefill legs' at once, the plain stream's once the
    # worker's next token finds the client gone
    wait_for(
        lambda: all(w.prompt_tokens_in_flight == 0 and w.outstanding == 0 for w in workers),
        timeout=15,
    )


def test_a_follow_up_goes_to_the_decode_worker_holding_its_conversation(start_router):
    router, fakes = start_router(
        {"prefill": 1, "decode": 3}, decode_policy="prefix-aware", max_local_prefill_length=20
    )
    first_turn = words(40)
    ask(router, first_turn)
    (holder,) = [fake for fake in fakes["decode"] if fake.kinds()]
    assert holder.kinds() == ["decode"]
    # The second turn repeats the first: only its new words are uncached on the holder, few
    # enough to prefill there, so it goes whole to the holder.
    for turn in range(3):
        ask(router, first_turn + " " + words(5, first=1000 + 10 * turn))
    assert holder.kinds() == ["decode", "plain", "plain", "plain"]
    assert sum(len(fake.kinds()) for fake in fakes["decode"]) == 4
    assert fakes["prefill"][0].kinds() == ["prefill"]
    hits = metric_samples(router.url)['tandem_router_decode_prefix_tokens_total{kind="hit"}']
    # each follow-up found the first turn's two whole 64-character blocks, at 4 characters a token
    assert len(first_turn) == 149 and hits == 3 * (2 * 64 // 4)


def test_auto_workers_take_up_prefill_and_give_it_back_without_losing_a_request(start_router):
    router, fakes = start_router(
        {"auto": 2},
        max_local_prefill_length=20,
        planner_prefill_queue_high=1000,
        planner_prefill_queue_low=100,
        planner_dwell_s=0.0,
        planner_idle_s=1.0,
    )
    autos = fakes["auto"]
    pool = router.app.state.pool
    wait_for(lambda: [w.serving_role for w in pool.available(("decode",))] == ["decode"] * 2)
    ask(router, words(30))  # no worker prefills: whole, though long
    assert sorted(len(fake.kinds()) for fake in autos) == [0, 1]
    assert decisions(router) == {'decision="whole",reason="no_prefill_worker"': 1.0}

    # Both build up long local prefill queues, and the streams they decode slow down (the
    # default planner_decode_tpot_high_ms, 50): the planner moves one to prefill.
    for fake in autos:
        fake.control.load = {"tokens_waiting": 5000, "tpot_p90_ms": 80}
    wait_for(lambda: len(pool.available(("prefill",))) == 1)
    (prefiller,) = pool.available(("prefill",))
    # A prefill worker with prompts waiting (between the marks; a request in flight, idle_ms 0)
    # is not idle, so it stays.
    for fake in autos:
        fake.control.load = {"tokens_waiting": 500}
    prefilling = next(fake for fake in autos if fake.url == prefiller.url)
    decoding = next(fake for fake in autos if fake.url != prefiller.url)
    before = (len(prefilling.kinds()), len(decoding.kinds()))
    ask(router, words(30, first=200))
    assert prefilling.kinds()[before[0] :] == ["prefill"]
    assert decoding.kinds()[before[1] :] == ["decode"]

    # The planner gives prefill back while a disaggregated stream is still decoding: the
    # stream ends whole, and the next request goes whole.
    decoding.control.token_delay_s = 0.1
    in_flight = threading.Thread(target=ask, args=(router, words(30, first=300), 12))
    in_flight.start()
    wait_for(lambda: decoding.kinds()[-1:] == ["decode"] and len(decoding.kinds()) > before[1] + 1)
    for fake in autos:
        fake.control.load = {"tokens_waiting": 0, "idle_ms": 1000}  # idle for the idle time
    wait_for(lambda: len(pool.available(("prefill",))) == 0)
    assert in_flight.is_alive()  # still decoding when the duty changed
    in_flight.join(timeout=10)
    ask(router, words(30, first=400))
    assert prefilling.kinds()[-1] == "plain" or decoding.kinds()[-1] == "plain"
    assert all(fake.stats.aborted_streams == fake.stats.aborted_prefills == 0 for fake in autos)
    assert decoding.stats.completed_streams == len(decoding.kinds())
    samples = metric_samples(router.url)
    assert samples['tandem_router_role_changes_total{duty="prefill"}'] == 1
    assert samples['tandem_router_role_changes_total{duty="decode"}'] == 1


# ---- the launcher: auto workers and the router's adaptive keys --------------------------------


def test_a_cluster_file_starts_auto_workers_and_passes_the_adaptive_router_keys():
    spec = parse_cluster(
        {
            "roles": {"auto": {"count": 2, "engine": {"kv_transport": "tcp"}}},
            "router": {
                "disaggregation": "conditional",
                "decode_policy": "prefix-aware",
                "max_local_prefill_length": 256,
                "planner_dwell_s": 2.5,
            },
        }
    )
    plans = plan_processes(spec, "cpu", num_gpus=0, python="py")
    assert [plan.name for plan in plans] == ["auto-0", "auto-1", "router"]
    assert all(plan.argv[plan.argv.index("--role") + 1] == "auto" for plan in plans[:2])
    router = plans[-1].argv
    autos = [router[i + 1] for i, arg in enumerate(router) if arg == "--auto"]
    assert autos == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    given = {router[i]: router[i + 1] for i in range(len(router) - 1) if router[i][:2] == "--"}
    assert given["--disaggregation"] == "conditional"
    assert given["--decode-policy"] == "prefix-aware"
    assert given["--max-local-prefill-length"] == "256" and given["--planner-dwell-s"] == "2.5"
    assert "--max-prefill-queue-tokens" not in given  # unset keys keep the router's defaults
    assert expected_router_counts(plans) == {"prefill": 0, "decode": 2, "both": 0}
    # The same from tandem serve's flags, which the router's choices must accept.
    from tandem.cli import build_parser
    from tandem.launcher.cli import cluster_data
    from tandem.router.config import DECODE_POLICIES, PREFILL_POLICIES

    flags = ["--prefill-policy", "round-robin", "--decode-policy", "prefix-aware"]
    flags += ["--planner-decode-tpot-high-ms", "12", "--planner-decode-kv-high", "0.7"]
    serve = build_parser().parse_args(["serve", *flags])
    router = plan_processes(parse_cluster(cluster_data(serve)), "cpu", 0, python="py")[-1].argv
    given = {router[i]: router[i + 1] for i in range(len(router) - 1) if router[i][:2] == "--"}
    assert (given["--prefill-policy"], given["--decode-policy"]) == ("round-robin", "prefix-aware")
    assert given["--planner-decode-tpot-high-ms"] == "12"
    assert given["--planner-decode-kv-high"] == "0.7"
    assert "--planner-dwell-s" not in given  # a flag not given keeps the router's default
    # every router key a cluster file passes on is a `tandem serve` flag, and the router's
    router_parser = build_parser()._subparsers._group_actions[0].choices["router"]
    router_flags = {option for action in router_parser._actions for option in action.option_strings}
    serve = build_parser().parse_args(["serve"])
    for name in ADAPTIVE_ROUTER_KEYS:
        assert f"--{name.replace('_', '-')}" in router_flags and hasattr(serve, name), name
    serve_parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    choices = {action.dest: set(action.choices or ()) for action in serve_parser._actions}
    assert choices["prefill_policy"] == set(PREFILL_POLICIES)
    assert choices["decode_policy"] == set(DECODE_POLICIES)
    # Auto workers feed decode workers, or take their KV: one layout and transport.
    tcp = {"kv_transport": "tcp"}
    parse_cluster({"roles": {"decode": {"count": 1, "engine": tcp}, "auto": {"count": 1}}})
    with pytest.raises(ClusterError, match="roles.auto.engine.block_size"):
        parse_cluster(
            {
                "roles": {
                    "decode": {"count": 1, "engine": {"kv_transport": "tcp"}},
                    "auto": {"count": 1, "engine": {"kv_transport": "tcp", "block_size": 32}},
                }
            }
        )
