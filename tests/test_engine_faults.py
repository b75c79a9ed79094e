"""Engine faults: contained to their request or step, and an engine that dies, on real `tandem
worker` processes (CPU, a tiny random checkpoint) and on an engine core in this process.

The workers' faults come from the test-only plug-in tests/fault_plugins (on their PYTHONPATH,
TANDEM_TEST_FAULT says where to raise for a request whose prompt holds a given token id). Every
answer is checked against the same request answered by the same worker before any fault
(greedy, so token for token). The tiny model has no EOS: a request runs to max_tokens; PROMPT's
steps are slowed on purpose, so that a request beside the one that fails is still running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from pd_fixtures import assert_nothing_held, metric, wait_until
from tandem.engine.config import EngineConfig
from tandem.engine.core import MAX_FAILED_STEPS, EngineCore, FatalEngineError
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.server.main import ENGINE_DIED_EXIT_CODE
from worker_fixtures import WorkerProcess, start_worker

PLUGIN_DIR = Path(__file__).resolve().parent / "fault_plugins"
ADMIT, UPDATE, STEP, CUDA, SLOW, HANG = 501, 502, 503, 504, 505, 506  # the poisoned token ids
FAULTS = f"admit:{ADMIT},update:{UPDATE},step:{STEP},cuda:{CUDA},slow:{SLOW},hang:{HANG}"
CHECKPOINT = "llama-gqa"
WORKER_FLAGS = ("--num-kv-blocks", "256")
PROMPT = [SLOW, *range(10, 40)]  # its steps take 20 ms or more (the plug-in's slow fault)
LONG = 100  # max_tokens of a request still running while a test acts (2 s or more)
BUSY = 900  # max_tokens of requests that keep an engine busy for 18 s or more
TIMEOUT = httpx.Timeout(60.0)
STEP_TIMEOUT_S = 3  # the execute-model timeout of the worker whose step hangs


def body(prompt: list[int], max_tokens: int, **fields) -> dict:
    greedy = {"temperature": 0.0, "return_token_ids": True}
    return {"prompt": prompt, "max_tokens": max_tokens, **greedy, **fields}


def start_faulty_worker(
    log_dir: Path, model: str, *flags: str, step_timeout_s: float | None = None
) -> WorkerProcess:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_TEST_FAULT", FAULTS)
        if step_timeout_s is not None:
            patch.setenv("TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(step_timeout_s))
        paths = [str(PLUGIN_DIR), os.environ.get("PYTHONPATH")]
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
        return start_worker(log_dir, *WORKER_FLAGS, *flags, model=model)


@pytest.fixture(scope="module")
def workers(tiny_checkpoints, tmp_path_factory) -> Iterator[dict[str, WorkerProcess]]:
    """Started together (start-up dominates): one that lives through the module, and one for
    each test that ends its worker."""
    model = str(tiny_checkpoints[CHECKPOINT])
    log_dir = tmp_path_factory.mktemp("engine-faults")
    names = ("faulty", "engine killed", "engine failed", "worker killed")
    started = {name: start_faulty_worker(log_dir, model) for name in names}
    started["engine hung"] = start_faulty_worker(log_dir, model, step_timeout_s=STEP_TIMEOUT_S)
    try:
        for worker in started.values():
            worker.wait_healthy()
        yield started
    finally:
        for worker in started.values():
            worker.stop()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def references(workers, client) -> dict[int, list[int]]:
    """max_tokens -> the token ids a normal request with PROMPT answers, before any fault."""
    url = workers["faulty"].url
    return {max_tokens: answer(client, url, max_tokens) for max_tokens in (8, LONG)}


def answer(client: httpx.Client, url: str, max_tokens: int) -> list[int]:
    """The token ids of a normal request with PROMPT."""
    response = client.post(url + "/v1/completions", json=body(PROMPT, max_tokens))
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def stream_chunks(response: httpx.Response) -> Iterator[dict]:
    """The JSON chunks of an SSE response as they come (checked to end with [DONE])."""
    lines = response.iter_lines()
    for line in lines:
        if line == "data: [DONE]":
            assert not any(rest.strip() for rest in lines), "data after [DONE]"
            return
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream did not end with [DONE]")


def token_ids(chunks: list[dict]) -> list[int]:
    return [
        t for chunk in chunks for choice in chunk.get("choices", []) for t in choice["token_ids"]
    ]


def assert_server_error(response: httpx.Response, status: int, *parts: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    kind = "server_error" if status == 500 else "service_unavailable"
    assert (error["code"], error["type"]) == (status, kind), error
    assert all(part in error["message"] for part in parts), error["message"]


def run_beside_a_stream(
    client: httpx.Client, url: str, act: Callable[[], httpx.Response]
) -> tuple[list[dict], httpx.Response]:
    """Start a long streamed request, run `act()` once its first token is out, then read the
    stream to its end; (its chunks, what act returned). The stream is checked to be still
    running when act returns (the engine reports it running)."""
    with client.stream(
        "POST", url + "/v1/completions", json=body(PROMPT, LONG, stream=True)
    ) as response:
        assert response.status_code == 200
        chunks = stream_chunks(response)
        first = next(chunks)
        result = act()
        assert metric(url, "tandem_requests_running") >= 1, "the stream ended before the act"
        return [first, *chunks], result


# -- one request's fault fails it alone --------------------------------------------------------


@pytest.mark.parametrize(
    "poison, cause",
    [
        (ADMIT, "the engine could not admit this request (RuntimeError: a fault injected"),
        (UPDATE, "its step's output could not be taken (KeyError: 'a fault injected"),
    ],
    ids=["admission", "update"],
)
@pytest.mark.parametrize("streamed", [False, True], ids=["collected", "streamed"])
def test_a_failing_request_fails_alone(workers, client, references, poison, cause, streamed):
    """The original bug: one request's bad input crashed the engine, and every later request
    hung. Now that request gets a 500 naming the cause (before any stream byte), a request
    running beside it and one after it are answered right, and nothing stays held."""
    url = workers["faulty"].url

    def poisoned() -> httpx.Response:
        request = body([*PROMPT, poison], 8, stream=streamed)
        return client.post(url + "/v1/completions", json=request)

    chunks, failed = run_beside_a_stream(client, url, poisoned)
    assert_server_error(failed, 500, cause)
    assert token_ids(chunks) == references[LONG]
    assert client.get(url + "/health").status_code == 200
    assert answer(client, url, 8) == references[8]
    assert_nothing_held(url)


def test_a_failing_step_fails_its_batch_and_the_engine_goes_on(workers, client, references):
    """The model's forward raises for a batch: nothing pins it on one request, so the batch's
    requests fail (the stream beside the poisoned request ends with an error event) and the
    engine serves the next request right."""
    url = workers["faulty"].url
    with client.stream(
        "POST", url + "/v1/completions", json=body(PROMPT, LONG, stream=True)
    ) as response:
        chunks = stream_chunks(response)
        first = next(chunks)
        failed = client.post(url + "/v1/completions", json=body([STEP, *PROMPT], 8))
        rest = list(chunks)
    assert_server_error(failed, 500, "step that ran this request failed (IndexError: index out")
    error = rest[-1]["error"]
    assert error["code"] == 500 and "IndexError" in error["message"], error
    streamed = token_ids([first, *rest[:-1]])
    assert streamed == references[LONG][: len(streamed)]
    assert client.get(url + "/health").status_code == 200
    assert answer(client, url, 8) == references[8]
    assert_nothing_held(url)


# -- an engine that dies ---------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def engine_pid(worker: WorkerProcess) -> int:
    """The worker's engine core process: its child that multiprocessing spawned."""
    for pid in children(worker.process.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if b"spawn_main" in cmdline.read():
                return pid
    raise AssertionError("the worker has no engine process")


def is_gone(pid: int) -> bool:
    """Exited (a zombie no one reaped counts: it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def wait_for_exit(worker: WorkerProcess, timeout: float) -> int:
    try:
        return worker.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within {timeout} s:\n{worker.log_tail()}")


def test_an_engine_killed_fails_what_is_in_flight_and_the_worker_exits(workers, client):
    """SIGKILL of the engine process: at once the worker says 503 on /health and to new
    requests, a started stream ends with a 503 error event, a collected request in flight gets
    a 503, and the worker exits with code 3 for its supervisor to restart it. Before, every
    request hung and /health could stay 200."""
    worker = workers["engine killed"]
    url = worker.url
    with client.stream(
        "POST", url + "/v1/completions", json=body(PROMPT, BUSY, stream=True)
    ) as response:
        chunks = stream_chunks(response)
        next(chunks)
        with ThreadPoolExecutor(1) as pool:
            collected = pool.submit(client.post, url + "/v1/completions", json=body(PROMPT, BUSY))
            wait_until(lambda: metric(url, "tandem_requests_running") == 2, 10, "not in flight")
            os.kill(engine_pid(worker), signal.SIGKILL)
            killed_at = time.monotonic()
            wait_until(lambda: client.get(url + "/health").status_code == 503, 1.0, "/health")
            refused = client.post(url + "/v1/completions", json=body(PROMPT, 4))
            assert_server_error(refused, 503, "the engine process died; retry")
            assert_server_error(collected.result(), 503, "the engine process died; retry")
        rest = list(chunks)
    assert rest[-1]["error"]["code"] == 503, rest[-1]
    assert rest[-1]["error"]["message"] == "the engine process died; retry"
    assert time.monotonic() - killed_at < 2.0
    assert wait_for_exit(worker, 10) == ENGINE_DIED_EXIT_CODE
    assert "the engine process died" in worker.log_tail()


def test_a_cuda_error_ends_the_engine_and_the_worker(workers, client):
    """A CUDA error is sticky (no later kernel runs): the requests of its step get a 500 naming
    it, the engine exits, the worker answers 503 and exits with code 3."""
    worker = workers["engine failed"]
    url = worker.url
    failed = client.post(url + "/v1/completions", json=body([CUDA, *PROMPT], 8))
    assert_server_error(failed, 500, "RuntimeError: CUDA error: an illegal memory access")
    assert wait_for_exit(worker, 10) == ENGINE_DIED_EXIT_CODE
    log = worker.log_tail(20000)
    assert "the engine cannot go on and exits: a CUDA error" in log, log


def test_a_step_that_never_returns_ends_the_engine_and_the_worker(workers, client):
    """A step that hangs (the runner's launch never returns, as a kernel that never ends) at the
    execute-model timeout: the engine process ends with every thread's stack on stderr, a stream
    in flight ends with a 503 error event, the hung request gets a 503, and the worker exits
    with code 3 for its supervisor to restart it. Before, /health stayed 200 and both requests
    waited for ever. An engine idle for longer than the timeout (since the module's start) and a
    request that runs for longer are not ended: each call of a step is timed, nothing else."""
    worker = workers["engine hung"]
    url = worker.url
    long_request = client.post(url + "/v1/completions", json=body(PROMPT, 200))  # 4 s or more
    assert long_request.status_code == 200, long_request.text
    chunks, hung = run_beside_a_stream(
        client, url, lambda: client.post(url + "/v1/completions", json=body([HANG, *PROMPT], 4))
    )
    assert_server_error(hung, 503, "the engine process died; retry")
    assert chunks[-1]["error"]["code"] == 503, chunks[-1]
    assert wait_for_exit(worker, 10) == ENGINE_DIED_EXIT_CODE
    log = worker.log_tail(100_000)
    # the line says how long the step had run: the timeout, or up to a second more (its check)
    timed_out = f" s (TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS={STEP_TIMEOUT_S}): a kernel, or the"
    assert "the engine's step has run for " in log and timed_out in log, log
    assert "in hang_forever" in log, log  # faulthandler's dump of the hung thread


def test_the_engine_dies_with_its_worker_even_when_busy(workers, client):
    """SIGKILL of the worker (API) process while its engine steps: the engine is gone within
    2 s (the kernel kills it with its parent). Before, it stepped on for seconds."""
    worker = workers["worker killed"]
    engine = engine_pid(worker)
    stop = threading.Event()

    def keep_busy() -> None:
        with client.stream(
            "POST", worker.url + "/v1/completions", json=body(PROMPT, BUSY, stream=True)
        ) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(keep_busy) for _ in range(4)]
        wait_until(lambda: metric(worker.url, "tandem_requests_running") == 4, 10, "not busy")
        worker.process.kill()
        killed_at = time.monotonic()
        wait_until(lambda: is_gone(engine), 2.0, "the engine outlived its worker by 2 s")
        stop.set()
        for future in busy:
            try:
                future.result()
            except httpx.HTTPError:
                pass
    assert time.monotonic() - killed_at < 2.0


# -- the engine core in this process ---------------------------------------------------------------


@pytest.fixture
def core(tiny_checkpoints) -> Iterator[EngineCore]:
    engine = EngineCore(EngineConfig(model=str(tiny_checkpoints[CHECKPOINT]), num_kv_blocks=32))
    yield engine
    engine.shutdown()


def fail_forward(core: EngineCore, message: str) -> None:
    def launch(scheduler_output):
        raise RuntimeError(message)

    core.executor.launch_model = launch


def add(core: EngineCore, request_id: str, max_tokens: int = 4) -> None:
    core.add_request(Request(request_id, list(PROMPT), SamplingParams(max_tokens=max_tokens)))


def test_failed_steps_in_a_row_end_the_engine_and_a_success_resets_the_count(core):
    launch = core.executor.launch_model
    fail_forward(core, "a broken engine")
    for attempt in range(1, MAX_FAILED_STEPS + 1):
        pair = [f"r{attempt}a", f"r{attempt}b"]
        for request_id in pair:
            add(core, request_id)
        if attempt < MAX_FAILED_STEPS:
            outputs = core.step()
        else:
            with pytest.raises(FatalEngineError, match="3 steps failed in a row") as failure:
                core.step()
            outputs = failure.value.outputs
        assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
            (request_id, "error") for request_id in pair
        ]
        assert "RuntimeError: a broken engine" in outputs[0].error
        assert core.kv_manager.num_used_blocks == 0 and not core.has_work()
        if attempt == 1:  # a step that succeeds in between starts the count again
            core.executor.launch_model = launch
            add(core, "ok", max_tokens=1)
            assert [o.finish_reason for o in core.step()] == ["length"]
            fail_forward(core, "a broken engine")
            assert core.num_failed_steps == 0
            add(core, "again-a")
            add(core, "again-b")
            assert [o.finish_reason for o in core.step()] == ["error", "error"]


def test_no_number_of_failing_requests_alone_ends_the_engine(core):
    """A step of one request that fails is that request's fault, however often it happens."""
    fail_forward(core, "one bad request")
    for attempt in range(3 * MAX_FAILED_STEPS):
        add(core, f"bad{attempt}")
        assert [o.finish_reason for o in core.step()] == ["error"]
    assert core.num_failed_steps == 0 and core.kv_manager.num_used_blocks == 0


def test_a_cuda_error_ends_the_engine_at_once(core):
    fail_forward(core, "CUDA error: device-side assert triggered")
    add(core, "r")
    with pytest.raises(FatalEngineError, match="a CUDA error") as failure:
        core.step()
    assert [o.finish_reason for o in failure.value.outputs] == ["error"]
    assert core.kv_manager.num_used_blocks == 0


def test_a_one_rank_engine_on_the_cpu_times_its_steps_only_when_asked(core, monkeypatch):
    """A large model's step on the CPU can take minutes: no execute-model timeout there unless
    TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS is set (on a GPU, and at any TP size, always)."""
    assert core.executor.steps is None
    monkeypatch.setenv("TANDEM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7")
    timed = EngineCore(replace(core.config))
    try:
        assert timed.executor.steps.timeout_s == 7.0
    finally:
        timed.shutdown()
