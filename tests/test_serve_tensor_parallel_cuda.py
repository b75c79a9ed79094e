"""`tandem serve` on four GPUs with prefill and decode workers of different tensor-parallel sizes,
KV over cuda-ipc (each decode rank reads its KV heads from the prefill ranks that hold them),
every rank on a GPU of its own: the answers are token-identical to one colocated TP=1 worker's.

The tiny llama-gqa checkpoint (2 KV heads: one per rank at TP=2) in float32; 16 greedy prompts of
5 to 1000 tokens, some extending others, collected and streamed in turn. Layouts: one prefill
worker at TP=2 with two decode workers at TP=1, and two prefill workers at TP=1 with one decode
worker at TP=2. Checked besides the tokens: the decode workers read KV (the requests were
disaggregated) and hold no block afterwards. Marked cuda; skipped below four GPUs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from pd_fixtures import assert_nothing_held, metric, prompt_set, run_direct, wait_until
from worker_fixtures import WorkerProcess, free_port_block, start_tandem, start_worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs four GPUs"
    ),
]

CHECKPOINT = "llama-gqa"
PROMPTS = prompt_set(1000, 1, 512)
COMMON = ("--dtype", "float32", "--num-kv-blocks", "512")
LAYOUTS = {  # name -> (tandem serve's flags, number of prefill workers, of decode workers)
    "p1-tp2-d2-tp1": (("--prefill", "1", "--decode", "2", "--prefill-tp", "2"), 1, 2),
    "p2-tp1-d1-tp2": (("--prefill", "2", "--decode", "1", "--decode-tp", "2"), 2, 1),
}


def body(index: int, prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": index % 2 == 1}


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, tmp_path_factory) -> list:
    log_dir = tmp_path_factory.mktemp("serve-tp-reference")
    model = str(tiny_checkpoints[CHECKPOINT])
    worker = start_worker(log_dir, "--role", "both", "--device", "cuda", *COMMON, model=model)
    try:
        worker.wait_healthy()
        with httpx.Client() as client:
            return [
                run_direct(client, worker.url, "/v1/completions", body(index, prompt))
                for index, prompt in enumerate(PROMPTS)
            ]
    finally:
        worker.stop()


@pytest.fixture
def cluster(request, tiny_checkpoints, tmp_path: Path) -> Iterator[tuple[WorkerProcess, dict]]:
    """The layout's cluster, once `tandem serve` says every worker is up, and its workers' URLs
    by role (workers are planned prefill first, on consecutive ports)."""
    flags, num_prefill, num_decode = LAYOUTS[request.param]
    worker_ports, kv_ports = free_port_block(3), free_port_block(3)
    serve = start_tandem(
        tmp_path, "serve", str(tiny_checkpoints[CHECKPOINT]), *flags, *COMMON,
        "--kv-transport", "cuda-ipc", "--worker-port-base", str(worker_ports),
        "--kv-port-base", str(kv_ports),
    )  # fmt: skip
    try:
        wait_until(
            lambda: "tandem serve: ready at" in serve.log_tail(100_000),
            timeout=300,
            message=lambda: f"the cluster did not start:\n{serve.log_tail()}",
        )
        urls = [f"http://127.0.0.1:{worker_ports + i}" for i in range(num_prefill + num_decode)]
        yield serve, {"prefill": urls[:num_prefill], "decode": urls[num_prefill:]}
    finally:
        serve.stop()


@pytest.mark.parametrize("cluster", list(LAYOUTS), indirect=True)
def test_heterogeneous_layouts_answer_as_a_colocated_worker(cluster, reference):
    serve, workers = cluster
    with httpx.Client() as client:
        got = [
            run_direct(client, serve.url, "/v1/completions", body(index, prompt))
            for index, prompt in enumerate(PROMPTS)
        ]
    for index, (mine, expected) in enumerate(zip(got, reference, strict=True)):
        assert mine == expected, f"prompt {index} ({len(PROMPTS[index])} tokens)"
    received = sum(metric(url, "tandem_kv_transfer_blocks_received") for url in workers["decode"])
    assert received > 0
    assert_nothing_held(*workers["prefill"], *workers["decode"])
