"""`tandem serve` end to end with fake workers: start, serve, and stop leaving no process behind.

The launcher runs the real command lines (`python -m tandem.cli worker ...`), with a `tandem`
package on PYTHONPATH in front of the real one whose only difference is its `tandem.server`
subpackage: its `worker` command serves tandem.router.fake_worker instead of an engine. The
router and the launcher are the real ones.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tandem

SRC = Path(tandem.__file__).resolve().parents[1]

FAKE_SERVER_CLI = '''
"""A `tandem worker` that serves tandem.router.fake_worker."""


def add_parser(subparsers):
    parser = subparsers.add_parser("worker")
    for flag in ("--model", "--role", "--host", "--port", "--kv-port", "--device"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--kv-transport")
    parser.set_defaults(func=run)


def run(args):
    from tandem.access import api_key_from_env
    from tandem.router.fake_worker import serve_fake_worker

    return serve_fake_worker(
        args.role, args.model, args.host, int(args.port), api_key=api_key_from_env()
    )
'''


@pytest.fixture(scope="module")
def fake_tandem(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fake_tandem")
    package = root / "tandem"
    (package / "server").mkdir(parents=True)
    real_init = SRC / "tandem" / "__init__.py"
    (package / "__init__.py").write_text(  # the real package's names, and its modules
        f"exec(compile(open({str(real_init)!r}).read(), {str(real_init)!r}, 'exec'))\n"
        f"__path__.append({str(SRC / 'tandem')!r})\n"
    )
    (package / "server" / "__init__.py").write_text("")
    (package / "server" / "cli.py").write_text(FAKE_SERVER_CLI)
    return root


def free_port_block(size: int) -> int:
    """The first of `size` consecutive free ports."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + size > 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + size):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no block of free ports")


class Launcher:
    def __init__(self, fake_tandem: Path, *args: str) -> None:
        self.port = free_port_block(1)
        self.worker_port = free_port_block(3)
        kv_port = free_port_block(3)
        argv = [sys.executable, "-m", "tandem.cli", "serve", "--device", "cpu"]
        argv += ["--port", str(self.port), "--worker-port-base", str(self.worker_port)]
        argv += ["--kv-port-base", str(kv_port), "--stop-timeout", "5", *args]
        env = dict(os.environ, PYTHONPATH=f"{fake_tandem}{os.pathsep}{SRC}")
        self.process = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_for_line(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} line; output: {''.join(self.output)}") from None
            self.output.append(line)
            if text in line:
                return line

    def children(self) -> list[int]:
        return [pid for pid in all_pids() if parent_of(pid) == self.process.pid]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # state, ppid, ...


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def is_alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def wait_until_gone(pids: list[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(is_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if is_alive(p)]}"
        time.sleep(0.05)


@pytest.fixture
def launch(fake_tandem: Path) -> Iterator[type[Launcher]]:
    launchers: list[Launcher] = []

    def start(*args: str) -> Launcher:
        launcher = Launcher(fake_tandem, *args)
        launchers.append(launcher)
        return launcher

    yield start  # type: ignore[misc]
    for launcher in launchers:
        children = launcher.children() if launcher.process.poll() is None else []
        launcher.stop()
        for pid in children:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_every_process(launch):
    launcher = launch()
    launcher.wait_for_line("ready at")
    body = {"model": "smollm2-135m-instruct", "prompt": "hello world", "max_tokens": 3}
    answer = httpx.post(f"http://127.0.0.1:{launcher.port}/v1/completions", json=body).json()
    assert answer["choices"][0]["text"] == " hello world hello"
    children = launcher.children()
    assert len(children) == 3  # prefill, decode, router

    launcher.process.send_signal(signal.SIGINT)
    assert launcher.process.wait(timeout=15) == 0
    wait_until_gone(children, timeout=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_api_key_guards_the_router_and_every_worker(launch):
    """`tandem serve --api-key`: the router and both workers want the key, given to them in
    their environment (no child's command line holds it); the router sends it on, so a request
    with the key passes through both legs."""
    launcher = launch("--api-key", "sesame")
    launcher.wait_for_line("ready at")
    url = f"http://127.0.0.1:{launcher.port}/v1/completions"
    body = {"model": "smollm2-135m-instruct", "prompt": "hello world", "max_tokens": 3}
    assert httpx.post(url, json=body).status_code == 401
    answer = httpx.post(url, json=body, headers={"Authorization": "Bearer sesame"}).json()
    assert answer["choices"][0]["text"] == " hello world hello"
    for port in (launcher.worker_port, launcher.worker_port + 1):
        worker_url = f"http://127.0.0.1:{port}"
        assert httpx.get(worker_url + "/v1/models").status_code == 401
        assert httpx.get(worker_url + "/health").status_code == 200
    children = launcher.children()
    assert len(children) == 3
    assert not [pid for pid in children if b"sesame" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_launcher_takes_its_children_along(launch):
    launcher = launch()
    launcher.wait_for_line("ready at")
    children = launcher.children()
    assert len(children) == 3
    launcher.process.kill()
    launcher.process.wait()
    wait_until_gone(children, timeout=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_crashed_worker_stops_the_cluster(launch):
    launcher = launch()
    launcher.wait_for_line("ready at")
    children = launcher.children()
    decode_url = f"http://127.0.0.1:{launcher.worker_port + 1}"
    httpx.post(decode_url + "/fake/control", json={"exit": 3})
    line = launcher.wait_for_line("exited with code", timeout=10)
    assert "decode-0" in line and "code 3" in line
    assert launcher.process.wait(timeout=15) == 1
    wait_until_gone(children, timeout=5)


def test_a_worker_that_cannot_start_is_named(launch, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "roles:\n"
        "  prefill: {count: 1, engine: {kv_transport: tcp, extra_args: [--no-such-flag]}}\n"
        "  decode: {count: 1, engine: {kv_transport: tcp}}\n"
    )
    launcher = launch("--config", str(config))
    line = launcher.wait_for_line("did not start", timeout=30)
    assert "prefill-0" in line and "exited with code 2" in line
    assert launcher.process.wait(timeout=15) == 1
