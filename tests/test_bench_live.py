"""`tandem bench serve` against a real `tandem worker` on the default model (CPU).

A tiny sweep (8 prompts of 32 token ids, 8 output tokens with ignore_eos, concurrency 1 and 4):
every field is there, completed + failed = sent, and the token counts are the server's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.cli import main
from worker_fixtures import free_port

# minutes on two cores: `make test-all` runs it (see the Makefile)
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
STARTUP_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    command = [sys.executable, "-m", "tandem.cli", "worker", "--model", MODEL]
    command += ["--port", str(port), "--host", "127.0.0.1"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, f"worker exited:\n{log_path.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, (
                f"worker not healthy:\n{log_path.read_text()[-3000:]}"
            )
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


SUMMARY_FIELDS = (
    "duration completed failed total_input_tokens total_output_tokens request_throughput "
    "request_goodput output_throughput total_token_throughput max_output_tokens_per_s "
    "max_concurrent_requests input_lens output_lens ttfts itls generated_texts errors requests"
).split() + [
    f"{kind}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el", "ttst")
    for kind in ("mean", "median", "std", "p90", "p99")
]


def test_small_sweep_against_a_real_worker(worker_url: str, tmp_path: Path) -> None:
    flags = ["bench", "serve", "--base-url", worker_url, "--model", MODEL, "--num-prompts", "8"]
    flags += ["--random-input-len", "32", "--random-output-len", "8", "--ignore-eos"]
    flags += ["--max-concurrency", "1,4", "--result-dir", str(tmp_path), "--disable-tqdm"]
    flags += ["--result-filename", "live", "--goodput", "ttft:60000", "tpot:60000"]
    assert main(flags) == 0
    combined = json.loads((tmp_path / "live-sweep.json").read_text())
    assert combined["sweep_values"] == [1, 4]
    for point in combined["points"]:
        assert set(SUMMARY_FIELDS) <= set(point), set(SUMMARY_FIELDS) - set(point)
        assert point["completed"] + point["failed"] == 8 == len(point["requests"])
        assert point["failed"] == 0, point["errors"]
        # Token-id prompts and ignore_eos: the server's usage must say 32 in, 8 out.
        assert point["input_lens"] == [32] * 8
        assert point["output_lens"] == [8] * 8
        assert point["total_output_tokens"] == 64 and point["total_input_tokens"] == 256
        for entry in point["requests"]:
            assert entry["finish_reason"] == "length"
            assert entry["ttft_ms"] > 0 and entry["e2el_ms"] >= entry["ttft_ms"]
            expected_tpot = (entry["e2el_ms"] - entry["ttft_ms"]) / 7
            assert entry["tpot_ms"] == pytest.approx(expected_tpot)
        assert point["request_goodput"] == pytest.approx(point["request_throughput"])
    for concurrency in (1, 4):
        assert (tmp_path / f"live-infqps-concurrency{concurrency}.json").exists()


def test_chat_endpoint_against_a_real_worker(worker_url: str, tmp_path: Path) -> None:
    flags = ["bench", "serve", "--base-url", worker_url, "--model", MODEL, "--num-prompts", "2"]
    flags += ["--endpoint", "/v1/chat/completions", "--random-input-len", "16"]
    flags += ["--random-output-len", "4", "--ignore-eos", "--result-dir", str(tmp_path)]
    flags += ["--result-filename", "chat", "--disable-tqdm", "--num-warmups", "0"]
    assert main(flags) == 0
    point = json.loads((tmp_path / "chat.json").read_text())
    assert point["completed"] == 2 and point["failed"] == 0, point["errors"]
    assert point["output_lens"] == [4, 4]
    assert all(length > 16 for length in point["input_lens"])  # words plus the chat template
