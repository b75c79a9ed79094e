"""PD between prefill and decode workers of different tensor-parallel sizes (CPU, gloo, tcp):
token identity with a colocated TP=1 worker for (prefill TP, decode TP) = (1, 2), (2, 1) and
(2, 2), collected and streamed, with chunked prefill (the prefill workers take 32 tokens a step)
and prefix-cache hits on decode (prompts that extend earlier ones), and nothing held on any
worker afterwards. The reference is a `both` worker at TP=1: no KV moves there, so a head range
read from the wrong rank, or a rank that missed its install, changes the tokens.

The legs run directly first, then through a `tandem router` per pair (completions and chat,
collected in vLLM's order, streamed as a handoff). Then, with TP=2 on each side in turn: a
client that leaves mid-stream (and, slow, while the KV is on the way: the decode's ranks then
install a read for a request that is gone), and a KV transfer that breaks (a prefill whose KV
server drops every fetch after one layer, from the test-only plug-in tests/fault_plugins): the
default load-failure policy recomputes the prompt, so the answer is still the reference's; the
`fail` policy (slow) answers a clear error. A TP engine's blocks are its scheduler's (rank 0's
block pool; the other ranks keep no per-request state, only their KV-head shard of every
block; rank 0's host staging lives as long as a lease or a read), so `assert_nothing_held` on
the worker covers every rank. The default run keeps one router case per side at TP=2, and the
abort and the broken transfer at decode TP=2; the rest is marked slow.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedTokenizerFast

from pd_fixtures import (
    HTTP_TIMEOUT_S,
    assert_nothing_held,
    failures,
    metric,
    prefill_leg,
    prompt_set,
    read_stream,
    run_direct,
    run_pd,
    start_faulty_worker,
    token_prompt,
    wait_until,
    with_defaults,
)
from tiny_models import byte_level_bpe
from worker_fixtures import WorkerProcess, start_tandem

CHECKPOINT = "llama-gqa"  # 2 KV heads: one per rank at TP=2
VOCAB = (1, 512)
PROMPTS = prompt_set(1000, *VOCAB)[:10]  # 5 to 255 tokens, shared prefixes
MAX_TOKENS = 6
CHUNK = ("--max-num-batched-tokens", "32")
TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
COMMON = ("--num-kv-blocks", "512", "--chat-template", TEMPLATE)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LEASE_S = 3.5  # the faulty prefills' lease: what a broken transfer leaves goes by then
DELAY_S = 3.0
PREFILL_FAULTS = {"drop": "drop:1", "delay": f"delay:{DELAY_S}"}
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def words(seed: int, count: int) -> str:
    """`count` reproducible made-up words of one to three syllables."""
    ids = token_prompt(seed, 3 * count, 0, len(SYLLABLES))
    return " ".join(
        "".join(SYLLABLES[i] for i in ids[k : k + 1 + ids[k] % 3]) for k in range(0, 3 * count, 3)
    )


def chat_conversations() -> list[list[dict]]:
    """Conversations of about 6 to 270 tokens; later ones extend earlier ones (the template
    writes each message and a newline), so the decode workers' prefix caches hit."""
    first, second, third = words(1, 60), words(2, 20), words(3, 150)
    user = functools.partial(dict, role="user")
    return [
        [user(content=words(4, 3))],
        [user(content=first)],
        [user(content=first), user(content=second)],
        [user(content=third)],
        [user(content=first), user(content=second), user(content=third)],
    ]


CONVERSATIONS = chat_conversations()


def checkpoint_with_tokenizer(source: Path, directory: Path) -> Path:
    """`source` with a byte-level BPE tokenizer of the model's 512 tokens beside it, trained on
    the made-up words the chat tests send."""
    shutil.copytree(source, directory)
    core = byte_level_bpe([words(seed, 50) for seed in range(40)], VOCAB[1])
    assert core.get_vocab_size() == VOCAB[1]
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>").save_pretrained(directory)
    return directory


PAIRS = [(1, 2), (2, 1), (2, 2)]
PAIR_IDS = [f"p{a}-d{b}" for a, b in PAIRS]
SLOW = pytest.mark.slow
# TP=2 on each side in turn; the default run keeps the TP=2 decode (the ranks' installs)
ONE_SIDE_TP2 = [pytest.param((2, 1), marks=SLOW, id="p2-d1"), pytest.param((1, 2), id="p1-d2")]


class Cluster:
    """The module's processes. The PD workers ("prefill-{tp}", "decode-{tp}") and the `both`
    worker start with the module; the others the first time a test asks for them, so a run
    without the tests that need them pays nothing for them:

        prefill-{tp}-drop    its KV server drops every fetch after the first layer
        prefill-{tp}-delay   its KV server waits DELAY_S before it sends
        decode-{tp}-fail     --kv-load-failure-policy fail
        router(prefill, decode)   a `tandem router` over those two workers

    The faulty prefills lease for LEASE_S. Every process stops with the module."""

    def __init__(self, log_dir: Path, model: str) -> None:
        self.log_dir = log_dir
        self.model = model
        self.processes: dict[str, WorkerProcess] = {}

    def __getitem__(self, name: str) -> WorkerProcess:
        if name not in self.processes:
            self.start({name: self._later_worker(name)})
        return self.processes[name]

    def router(self, prefill: str, decode: str) -> WorkerProcess:
        name = f"router {prefill} {decode}"
        if name not in self.processes:
            urls = ("--prefill", self[prefill].url, "--decode", self[decode].url)
            self.start({name: functools.partial(start_tandem, self.log_dir, "router", *urls)})
        return self.processes[name]

    def start(self, starts: dict[str, Callable[[], WorkerProcess]]) -> None:
        """Start these processes at once and wait until every one is healthy."""
        for name, start in starts.items():
            self.processes[name] = start()
        for name in starts:
            self.processes[name].wait_healthy()

    def worker(self, fault: str | None, role: str, tp: str, *flags: str) -> WorkerProcess:
        flags = ("--role", role, "--tensor-parallel-size", tp, *COMMON, *flags)
        return start_faulty_worker(fault, self.log_dir, *flags, model=self.model)

    def _later_worker(self, name: str) -> Callable[[], WorkerProcess]:
        role, tp, variant = name.split("-")
        lease = ("--kv-lease-timeout", str(LEASE_S))
        if role == "prefill" and variant in PREFILL_FAULTS:
            return functools.partial(self.worker, PREFILL_FAULTS[variant], role, tp, *lease)
        if role == "decode" and variant == "fail":
            policy = ("--kv-load-failure-policy", "fail")
            return functools.partial(self.worker, None, role, tp, *policy)
        raise KeyError(name)

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop()


@pytest.fixture(scope="module")
def workers(tiny_checkpoints, tmp_path_factory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("pd-tp")
    model = str(checkpoint_with_tokenizer(tiny_checkpoints[CHECKPOINT], log_dir / "model"))
    cluster = Cluster(log_dir, model)
    specs = {
        "prefill-1": ("prefill", "1", *CHUNK),
        "prefill-2": ("prefill", "2", *CHUNK),
        "decode-1": ("decode", "1"),
        "decode-2": ("decode", "2"),
        "both": ("both", "1"),
    }
    try:
        cluster.start(
            {name: functools.partial(cluster.worker, None, *flags) for name, flags in specs.items()}
        )
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as http:
        yield http


def router_outcomes(router: WorkerProcess, outcome: str) -> float:
    """How many requests the router ended with this outcome (tandem_router_requests)."""
    text = httpx.get(f"{router.url}/metrics", timeout=10.0).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem_router_requests_total" and sample.labels["outcome"] == outcome
    )


def greedy(prompt: list[int], stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_token_ids_match_a_colocated_worker(client, workers, pair, stream):
    prefill, decode = workers[f"prefill-{pair[0]}"], workers[f"decode-{pair[1]}"]
    for prompt in PROMPTS[:: 2 if stream else 1]:
        body = greedy(prompt, stream)
        reference = run_direct(client, workers["both"].url, COMPLETIONS, body)
        pd = run_pd(client, prefill.url, decode.url, COMPLETIONS, body)
        assert pd == reference, f"prompt of {len(prompt)} tokens"
    assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_params_carry_the_tp_size_and_the_model_layout(client, workers, pair):
    prefill = workers[f"prefill-{pair[0]}"]
    body = greedy(PROMPTS[3], stream=False)
    answer = prefill_leg(client, prefill.url, COMPLETIONS, body)
    params = answer["kv_transfer_params"]
    assert params["tp_size"] == pair[0]
    # 2 layers, key and value, the model's 2 KV heads of 16: whatever the prefill's TP
    assert params["kv_layout"].split("x")[2] == "2", params["kv_layout"]
    release = client.post(
        prefill.url + "/v1/kv/release", json={"remote_request_id": params["remote_request_id"]}
    )
    assert release.status_code < 300, release.text
    assert_nothing_held(prefill)


@pytest.mark.parametrize(
    ("pair", "stream"),
    [
        pytest.param(pair, stream, id=f"p{pair[0]}-d{pair[1]}-{mode}", marks=marks)
        for pair in PAIRS
        for stream, mode in [(False, "collected"), (True, "streamed")]
        # one case per side at TP=2 in the default run, the others marked slow
        for marks in [() if (pair, stream) in [((2, 1), False), ((1, 2), True)] else SLOW]
    ],
)
def test_the_router_s_answers_match_a_colocated_worker(client, workers, pair, stream):
    """Completions (the module's prompts) and chat (conversations that extend each other)
    through the router: collected in vLLM's order, streamed as a handoff."""
    prefill, decode = workers[f"prefill-{pair[0]}"], workers[f"decode-{pair[1]}"]
    router = workers.router(f"prefill-{pair[0]}", f"decode-{pair[1]}")
    sent_before = metric(prefill, "tandem_kv_transfer_blocks_sent")
    requests = [(COMPLETIONS, greedy(prompt, stream)) for prompt in PROMPTS[1::3]]
    requests += [
        (
            CHAT,
            {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream},
        )
        for messages in CONVERSATIONS
    ]
    for path, body in requests:
        reference = run_direct(client, workers["both"].url, path, body)
        assert run_direct(client, router.url, path, body) == reference, (path, body)
    assert metric(prefill, "tandem_kv_transfer_blocks_sent") > sent_before  # PD it was
    assert_nothing_held(prefill, decode)


def read_chunks_then_leave(router: WorkerProcess, body: dict, num_chunks: int) -> None:
    """Stream `body` through the router, read `num_chunks` SSE events, close the connection."""
    with (
        httpx.Client(timeout=HTTP_TIMEOUT_S) as own,
        own.stream("POST", router.url + COMPLETIONS, json=with_defaults(body)) as response,
    ):
        assert response.status_code == 200, response.read()
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(num_chunks):
            assert next(events) != "data: [DONE]"


@pytest.mark.parametrize("pair", ONE_SIDE_TP2)
def test_a_client_that_leaves_mid_stream_leaves_nothing_held(client, workers, pair):
    """The client closes after the first token (the decode leg may still be loading and
    installing on its ranks) and, again, a few tokens into the decode: both legs end, every
    block comes back, and the next request is right."""
    prefill, decode = workers[f"prefill-{pair[0]}"], workers[f"decode-{pair[1]}"]
    router = workers.router(f"prefill-{pair[0]}", f"decode-{pair[1]}")
    max_tokens = 600  # far more than the client waits for
    aborted_before = router_outcomes(router, "aborted")
    generated_before = metric(decode, "tandem_generation_tokens_total")
    for seed, num_chunks in [(21, 1), (22, 4)]:
        prompt = token_prompt(seed + 10 * pair[0], 150, *VOCAB)
        read_chunks_then_leave(router, greedy(prompt, True, max_tokens), num_chunks)
    wait_until(
        lambda: router_outcomes(router, "aborted") == aborted_before + 2,
        30,
        lambda: f"the router counted {router_outcomes(router, 'aborted') - aborted_before} aborts",
    )
    assert_nothing_held(prefill, decode, timeout=30)
    generated = metric(decode, "tandem_generation_tokens_total") - generated_before
    assert generated < max_tokens, f"the decode worker generated {generated} tokens"
    body = greedy(PROMPTS[7], stream=True)
    reference = run_direct(client, workers["both"].url, COMPLETIONS, body)
    assert run_direct(client, router.url, COMPLETIONS, body) == reference
    assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("pair", ONE_SIDE_TP2)
def test_a_broken_transfer_is_recomputed_and_both_workers_go_on(client, workers, pair):
    """The prefill's KV server drops the connection after the first layer, collected (vLLM's
    order) and streamed (a handoff: the announced first token is kept): the decode worker
    recomputes the prompt on all its ranks, and the answers are the reference's."""
    prefill_name = f"prefill-{pair[0]}-drop"
    prefill, decode = workers[prefill_name], workers[f"decode-{pair[1]}"]
    router = workers.router(prefill_name, f"decode-{pair[1]}")
    broken_before = failures(decode, "connection")
    for seed, stream in [(31, False), (32, True)]:
        # prompts no decode worker has cached: the load must read every block
        body = greedy(token_prompt(seed + 10 * pair[0], 120, *VOCAB), stream)
        reference = run_direct(client, workers["both"].url, COMPLETIONS, body)
        assert run_direct(client, router.url, COMPLETIONS, body) == reference, stream
    wait_until(
        lambda: failures(decode, "connection") == broken_before + 2,
        10,
        lambda: f"{failures(decode, 'connection') - broken_before} broken transfers counted",
    )
    assert_nothing_held(prefill, decode, timeout=LEASE_S + 10)
    # both go on: the faulty prefill serves a request whole, the decode one a PD request
    body = greedy(token_prompt(33 + 10 * pair[0], 90, *VOCAB), stream=True)
    reference = run_direct(client, workers["both"].url, COMPLETIONS, body)
    assert run_direct(client, prefill.url, COMPLETIONS, body) == reference
    healthy = workers.router(f"prefill-{pair[0]}", f"decode-{pair[1]}")
    assert run_direct(client, healthy.url, COMPLETIONS, body) == reference
    assert_nothing_held(prefill, decode, workers[f"prefill-{pair[0]}"])


@SLOW
def test_a_client_that_leaves_while_the_kv_is_on_the_way_leaves_nothing_held(client, workers):
    """(1, 2), the prefill's KV server waiting DELAY_S before it sends: every block comes back
    on both workers, and the decode worker goes on.

    Legs sent directly: the client gives the decode leg up while rank 0 of the decode worker
    waits on its read (after the first token, which the decode worker sends at once);
    nothing releases the lease, so the read ends, both ranks install their heads of it into
    blocks that no request owns any more, and only then do those come back. Through the
    router: the client leaves after the first token; the router releases the prefill's
    lease, so the read ends withdrawn (or, should the release come after the bytes on a slow
    machine, it installs as above)."""
    prefill, decode = workers["prefill-1-delay"], workers["decode-2"]
    router = workers.router("prefill-1-delay", "decode-2")
    received_before = metric(decode, "tandem_kv_transfer_blocks_received")
    withdrawn_before = failures(decode, "aborted")
    generated_before = metric(decode, "tandem_generation_tokens_total")

    # seeds past 100: no earlier test's prompt shares their prefix, which the decode worker
    # would then hold and not read (21 to 53 are taken)
    body = with_defaults(greedy(token_prompt(141, 150, *VOCAB), True, 600))  # 10 blocks
    params = prefill_leg(client, prefill.url, COMPLETIONS, body)["kv_transfer_params"]
    with pytest.raises(httpx.TimeoutException):  # gone long before the KV comes
        client.post(
            decode.url + COMPLETIONS, json=dict(body, kv_transfer_params=params), timeout=0.5
        )
    assert_nothing_held(prefill, decode, timeout=DELAY_S + 20)
    assert metric(decode, "tandem_kv_transfer_blocks_received") - received_before == 10
    # only the first token, which the prefill computed and the decode worker sends at once
    assert metric(decode, "tandem_generation_tokens_total") - generated_before == 1

    generated_before = metric(decode, "tandem_generation_tokens_total")
    received_before = metric(decode, "tandem_kv_transfer_blocks_received")
    aborted_before = router_outcomes(router, "aborted")
    read_chunks_then_leave(router, greedy(token_prompt(142, 150, *VOCAB), True, 600), 1)
    wait_until(lambda: router_outcomes(router, "aborted") == aborted_before + 1, 30, "no abort")
    assert_nothing_held(prefill, decode, timeout=DELAY_S + 20)
    received = metric(decode, "tandem_kv_transfer_blocks_received") - received_before
    withdrawn = failures(decode, "aborted") - withdrawn_before
    assert (withdrawn, received) in [(1, 0), (0, 10)], (withdrawn, received)

    # at most the prefill's first token, when the failed read's report outruns the abort
    generated = metric(decode, "tandem_generation_tokens_total") - generated_before
    assert generated <= 1, f"the decode worker generated {generated} tokens"
    body = greedy(PROMPTS[8], stream=True)
    reference = run_direct(client, workers["both"].url, COMPLETIONS, body)
    healthy = workers.router("prefill-1", "decode-2")
    assert run_direct(client, healthy.url, COMPLETIONS, body) == reference
    assert_nothing_held(workers["prefill-1"], decode)


@SLOW
def test_a_broken_transfer_is_a_clear_error_with_the_fail_policy(client, workers):
    """(1, 2), the decode worker started with --kv-load-failure-policy fail: collected, the
    router relays its 500; streamed, the first token (the prefill's) and then an error event.
    Nothing is held afterwards and the decode worker goes on."""
    prefill, decode = workers["prefill-1-drop"], workers["decode-2-fail"]
    router = workers.router("prefill-1-drop", "decode-2-fail")
    broken_before = failures(decode, "connection")
    message = "the KV transfer from the prefill worker failed (connection)"
    collected = with_defaults(greedy(token_prompt(151, 120, *VOCAB), stream=False))
    response = client.post(router.url + COMPLETIONS, json=collected, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 500, response.text
    assert response.json()["error"]["message"] == message
    streamed = with_defaults(greedy(token_prompt(152, 120, *VOCAB), stream=True))
    reference = run_direct(client, workers["both"].url, COMPLETIONS, streamed)
    with client.stream(
        "POST", router.url + COMPLETIONS, json=streamed, timeout=HTTP_TIMEOUT_S
    ) as response:
        assert response.status_code == 200
        chunks = read_stream(response)
    assert chunks[0]["choices"][0]["token_ids"] == reference.token_ids[:1]
    assert message in chunks[-1]["error"]["message"], chunks[-1]
    assert failures(decode, "connection") == broken_before + 2
    assert_nothing_held(prefill, decode, timeout=LEASE_S + 10)
    assert run_direct(client, decode.url, COMPLETIONS, streamed) == reference
