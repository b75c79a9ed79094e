"""Real `tandem worker` subprocesses for tests, and readers of their Prometheus metrics.

`start_worker` launches a worker on a free loopback port in a session of its own and returns at
once, so a test module can do other slow set-up (loading a reference engine) while the worker
boots; `WorkerProcess.wait_healthy` then waits for `/health` == 200. `running_worker` wraps both
and always stops the worker's whole process group (engine core included) on the way out, with
SIGTERM first and SIGKILL if it lingers.

Workers run with one intra-op thread (OMP_NUM_THREADS=1 unless the caller's environment sets it):
on a small machine shared by several processes, torch's default of one thread per core makes a
CPU decode step several times slower through thread contention.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem import DEFAULT_MODEL
from tandem.bench.compare import ephemeral_port_floor

STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    return free_port_block(1)


def free_port_block(size: int) -> int:
    """The first of `size` consecutive ports free now on every interface, between Ray's worker
    ports (10002-19999, taken at will by a Ray cluster of another test) and the kernel's
    ephemeral range: a port from that range can be taken, before its server binds it, by an
    outgoing connection, even by a connection to the port itself (a router's health check of a
    worker that does not listen yet connects to itself), and the server then fails with
    "address already in use"."""
    ceiling = ephemeral_port_floor() - size
    for _ in range(100):
        first = random.randrange(min(20000, ceiling // 2), ceiling)
        sockets = []
        try:
            for port in range(first, first + size):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no block of free ports")


@dataclass
class WorkerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"the worker exited with code {code}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker was not healthy in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def send_signal(self, signum: int) -> None:
        """Send signum to the worker's main process only (as a process manager would)."""
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the whole process group (the engine core included) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """Stop the whole process group; idempotent."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # the engine core may outlive a main process that was killed


def start_worker(
    log_dir: Path, *flags: str, model: str = DEFAULT_MODEL, port: int | None = None
) -> WorkerProcess:
    """Launch `tandem worker --model model *flags` on `port` (default: a free one); does not
    wait for health."""
    return start_tandem(log_dir, "worker", "--model", model, *flags, port=port)


def start_tandem(
    log_dir: Path, command: str, *flags: str, port: int | None = None
) -> WorkerProcess:
    """Launch `tandem command *flags --host 127.0.0.1 --port port` (a worker or a router)."""
    port = port or free_port()
    log_path = Path(log_dir) / f"{command}-{port}.log"
    argv = [sys.executable, "-m", "tandem.cli", command, *flags]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    source_dir = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_dir, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return WorkerProcess(process, port, log_path)


@contextlib.contextmanager
def running_worker(
    log_dir: Path, *flags: str, model: str = DEFAULT_MODEL
) -> Iterator[WorkerProcess]:
    """A healthy worker for the duration of the block, always stopped afterwards."""
    worker = start_worker(log_dir, *flags, model=model)
    try:
        worker.wait_healthy()
        yield worker
    finally:
        worker.stop()


def rank_pids_in_log(log: str) -> list[int]:
    """A TP=2 worker's engine process and its rank 1, from the line the engine logs at start."""
    match = re.search(r"tensor parallelism: 2 ranks \(pids \[(\d+), (\d+)\]\)", log)
    assert match, log
    return [int(match[1]), int(match[2])]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} and {"name": value} for unlabelled samples;
    a family's samples with labels are also summed under the bare name."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
        name = key.split("{", 1)[0]
        if name != key:
            values[name] = values.get(name, 0.0) + float(value)
    return values


def read_metrics(url: str) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics", timeout=10.0)
    response.raise_for_status()
    return parse_metrics(response.text)


def wait_for_metric(url: str, name: str, expected: float, timeout: float = 10.0) -> float:
    """Poll /metrics until metric `name` equals expected; returns the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = read_metrics(url).get(name)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def sse_payloads_across_a_sigterm(
    url: str,
    body: dict,
    server: subprocess.Popen,
    end_within_s: float,
    signum: int = signal.SIGTERM,
) -> list[str]:
    """POST a streamed `body` to url; once its first line is in, send `server` SIGTERM (or
    `signum`); the data payloads of the whole stream, which must have ended within
    end_within_s."""
    lines: list[str] = []
    started = threading.Event()

    def read_stream() -> None:
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert started.wait(timeout=30), "the stream did not start"
    server.send_signal(signum)
    reader.join(timeout=end_within_s)
    assert not reader.is_alive(), f"the stream did not end within {end_within_s} s"
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
