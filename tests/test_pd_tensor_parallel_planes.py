"""PD between tensor-parallel workers over the planes that read the prefill's cache in place
(kv/connector/rank_reads.py): every decode rank reads its KV heads from the prefill ranks that
hold them. CPU (gloo) over nixl (UCX_TLS=tcp) and mooncake (its tcp protocol); cuda-ipc on two
GPUs (marked cuda).

Through a `tandem router` (handoff) and directly in vLLM's order, collected and streamed, the
answers are token-identical to a colocated `both` worker at TP=1, for (prefill TP, decode TP) =
(1, 2): each decode rank reads part of the prefill's heads (staging), (2, 1): the decode reads
both prefill ranks (staging), (2, 2): each rank reads its twin's blocks whole; a head read from
the wrong rank, or a rank that missed its read, changes the tokens (the model has 2 KV heads,
one per rank at TP=2). A read that fails on decode rank 1 only (the test-only plug-in
tests/fault_plugins) fails the load on rank 0: the default policy recomputes the prompt and
the answer is still the reference's. Nothing stays held on any worker. The default run keeps
nixl (1, 2) and the failure; the other pairs are marked slow.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from pd_fixtures import (
    assert_nothing_held,
    failures,
    metric,
    prompt_set,
    run_direct,
    run_pd,
    token_prompt,
    wait_until,
)
from tandem.kv.data import installed
from worker_fixtures import WorkerProcess, start_tandem, start_worker

CHECKPOINT = "llama-gqa"  # 2 KV heads: one per rank at TP=2
VOCAB = (1, 512)
PROMPTS = prompt_set(1000, *VOCAB)[:6]
MAX_TOKENS = 5
COMMON = ("--num-kv-blocks", "512", "--max-num-batched-tokens", "64")
COMPLETIONS = "/v1/completions"
FAULT_PLUGIN_DIR = Path(__file__).resolve().parent / "fault_plugins"
LEASE_S = 3.5  # a "-short" prefill's lease: what a failed load leaves goes by then
SLOW = pytest.mark.slow
os.environ.setdefault("UCX_TLS", "tcp")  # this host has no RDMA: UCX over TCP, as in CI


def needs(transport: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not installed(transport), reason=f"{transport} missing")


CASES = [
    pytest.param("nixl", 1, 2, id="nixl-p1-d2", marks=needs("nixl")),
    pytest.param("nixl", 2, 1, id="nixl-p2-d1", marks=[needs("nixl"), SLOW]),
    pytest.param("nixl", 2, 2, id="nixl-p2-d2", marks=[needs("nixl"), SLOW]),
    pytest.param("mooncake", 2, 2, id="mooncake-p2-d2", marks=[needs("mooncake"), SLOW]),
]


class Workers:
    """Workers started the first time a test asks for them, named "{role}-{transport}-{tp}"
    (a "-faulty" decode fails every read its rank 1 makes, a "-short" prefill leases for
    LEASE_S) or "both"; "router {prefill} {decode}" is a router over two of them. Every process
    stops with the module."""

    def __init__(self, log_dir: Path, model: str, device_flags: tuple[str, ...]) -> None:
        self.log_dir, self.model, self.device_flags = log_dir, model, device_flags
        self.processes: dict[str, WorkerProcess] = {}

    def __getitem__(self, name: str) -> WorkerProcess:
        if name not in self.processes:
            self.start(name, self._starter(name))
        return self.processes[name]

    def start_all(self, *names: str) -> None:
        """Start the workers not yet running together, and wait for all of them."""
        starting = [name for name in names if name not in self.processes]
        for name in starting:
            self.processes[name] = self._starter(name)()
        for name in starting:
            self.processes[name].wait_healthy()

    def router(self, prefill: str, decode: str) -> WorkerProcess:
        name = f"router {prefill} {decode}"
        if name not in self.processes:
            urls = ("--prefill", self[prefill].url, "--decode", self[decode].url)
            self.start(name, functools.partial(start_tandem, self.log_dir, "router", *urls))
        return self.processes[name]

    def start(self, name: str, start: Callable[[], WorkerProcess]) -> None:
        self.processes[name] = start()
        self.processes[name].wait_healthy()

    def _starter(self, name: str) -> Callable[[], WorkerProcess]:
        flags = (*COMMON, *self.device_flags)
        if name == "both":
            return functools.partial(start_worker, self.log_dir, "--role", "both", *flags,
                                     model=self.model)  # fmt: skip
        role, rest = name.split("-", 1)  # the transport may hold a "-" (cuda-ipc)
        variant = [rest.rsplit("-", 1)[1]] if rest.endswith(("-short", "-faulty")) else []
        transport, tp = rest.removesuffix(f"-{variant[0]}" if variant else "").rsplit("-", 1)
        flags = ("--role", role, "--kv-transport", transport, "--tensor-parallel-size", tp,
                 "--kv-transfer-timeout", "10", *flags)  # fmt: skip
        if variant == ["short"]:
            flags = (*flags, "--kv-lease-timeout", str(LEASE_S))
        if variant != ["faulty"]:
            return functools.partial(start_worker, self.log_dir, *flags, model=self.model)

        def start_faulty() -> WorkerProcess:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("TANDEM_TEST_RANK_READ_FAULT", "1")
                paths = [str(FAULT_PLUGIN_DIR), os.environ.get("PYTHONPATH")]
                patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
                return start_worker(self.log_dir, *flags, model=self.model)

        return start_faulty

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop()


def running(tmp_path_factory, tiny_checkpoints, device_flags: tuple[str, ...]) -> Iterator[Workers]:
    workers = Workers(tmp_path_factory.mktemp("pd-tp-planes"), str(tiny_checkpoints[CHECKPOINT]),
                      device_flags)  # fmt: skip
    try:
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_checkpoints) -> Iterator[Workers]:
    yield from running(tmp_path_factory, tiny_checkpoints, ())


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as http:
        yield http


def greedy(prompt: list[int], stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream}


def assert_pd_matches_colocated(
    client: httpx.Client, workers: Workers, transport: str, prefill_tp: int, decode_tp: int
) -> None:
    """The module's prompts through a router (streamed: a handoff) and directly (collected,
    vLLM's order), each token-identical to the `both` worker; every block read, none held."""
    prefill_name, decode_name = (
        f"prefill-{transport}-{prefill_tp}",
        f"decode-{transport}-{decode_tp}",
    )
    workers.start_all("both", prefill_name, decode_name)
    prefill, decode = workers[prefill_name], workers[decode_name]
    router = workers.router(prefill_name, decode_name)
    received_before = metric(decode, "tandem_kv_transfer_blocks_received")
    for index, prompt in enumerate(PROMPTS):
        body = greedy(prompt, stream=index % 2 == 0)
        reference = run_direct(client, workers["both"].url, COMPLETIONS, body)
        if body["stream"]:
            answer = run_direct(client, router.url, COMPLETIONS, body)
        else:
            answer = run_pd(client, prefill.url, decode.url, COMPLETIONS, body)
        assert answer == reference, f"prompt {index} ({len(prompt)} tokens)"
    assert metric(decode, "tandem_kv_transfer_blocks_received") > received_before
    assert metric(decode, "tandem_kv_transfer_failures_total") == 0
    assert_nothing_held(prefill, decode)


@pytest.mark.parametrize(("transport", "prefill_tp", "decode_tp"), CASES)
def test_pd_matches_a_colocated_worker(client, workers, transport, prefill_tp, decode_tp):
    assert_pd_matches_colocated(client, workers, transport, prefill_tp, decode_tp)


@needs("nixl")
@SLOW  # 40 s, two workers of its own; rank reads' failure: tests/test_kv_rank_reads.py
def test_a_read_that_fails_on_rank_1_fails_the_load_on_rank_0(client, workers):
    """Decode rank 1's reads fail, rank 0's succeed: rank 0 reports the load failed
    (connection) once both ranks' reads have ended, the prompt is recomputed on both ranks, and
    the answers are the reference's; every block comes back (the prefill's once its lease,
    let go unconfirmed as after any failed load, expires), and both workers go on."""
    workers.start_all("both", "prefill-nixl-1-short", "decode-nixl-2-faulty")
    prefill, decode = workers["prefill-nixl-1-short"], workers["decode-nixl-2-faulty"]
    router = workers.router("prefill-nixl-1-short", "decode-nixl-2-faulty")
    broken_before = failures(decode, "connection")
    for seed, stream in [(31, False), (32, True)]:
        body = greedy(token_prompt(seed, 120, *VOCAB), stream)  # cached nowhere: 8 blocks read
        reference = run_direct(client, workers["both"].url, COMPLETIONS, body)
        assert run_direct(client, router.url, COMPLETIONS, body) == reference, stream
    wait_until(
        lambda: failures(decode, "connection") == broken_before + 2,
        10,
        lambda: f"{failures(decode, 'connection') - broken_before} failed loads counted",
    )
    assert_nothing_held(prefill, decode, timeout=LEASE_S + 10)
    body = greedy(PROMPTS[2], stream=True)  # the prefill goes on, whole
    assert run_direct(client, prefill.url, COMPLETIONS, body) == run_direct(
        client, workers["both"].url, COMPLETIONS, body
    )
    assert_nothing_held(prefill, decode)


# -- cuda-ipc, on GPUs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_workers(tmp_path_factory, tiny_checkpoints) -> Iterator[Workers]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    yield from running(
        tmp_path_factory, tiny_checkpoints, ("--device", "cuda", "--dtype", "float32")
    )


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(2, 2), (1, 2), (2, 1)], ids=["p2-d2", "p1-d2", "p2-d1"]
)
def test_pd_over_cuda_ipc_matches_a_colocated_worker(client, gpu_workers, prefill_tp, decode_tp):
    """Every worker's rank r on GPU r (the prefill's and the decode's ranks share the GPUs)."""
    assert_pd_matches_colocated(client, gpu_workers, "cuda-ipc", prefill_tp, decode_tp)
