"""`tandem serve` with fake processes: start, supervise (restart, give up), serve, and stop
leaving no process behind.

The supervisor's own tests run it in a thread over `python -c` children that answer /health as
told for each of their starts. The end-to-end ones run the launcher's real command lines
(`python -m tandem.cli worker ...`), with a `tandem` package on PYTHONPATH in front of the real
one whose only difference is its `tandem.server.cli`: its `worker` command serves
tests/fake_worker.py instead of an engine. The router and the launcher are the real ones.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tandem
from process_tree import alive
from tandem.access import CLUSTER_TOKEN_ENV
from tandem.launcher.plan import ProcessPlan
from tandem.launcher.supervisor import Supervisor
from worker_fixtures import free_port_block

SRC = Path(tandem.__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent  # fake_worker.py

FAKE_SERVER_CLI = '''
"""A `tandem worker` that serves tests/fake_worker.py."""


def add_parser(subparsers):
    parser = subparsers.add_parser("worker")
    for flag in ("--model", "--role", "--host", "--port", "--kv-port", "--device"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--kv-transport")
    parser.set_defaults(func=run)


def run(args):
    from tandem.access import api_key_from_env, cluster_token_from_env
    from fake_worker import serve_fake_worker

    return serve_fake_worker(
        args.role,
        args.model,
        args.host,
        int(args.port),
        api_key=api_key_from_env(),
        cluster_token=cluster_token_from_env(),
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
    (package / "server" / "__init__.py").write_text(  # the real subpackage's other modules
        f"__path__.append({str(SRC / 'tandem' / 'server')!r})\n"
    )
    (package / "server" / "cli.py").write_text(FAKE_SERVER_CLI)
    return root


class Launcher:
    def __init__(self, fake_tandem: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port_block(1)
        self.worker_port = free_port_block(3)
        kv_port = free_port_block(3)
        argv = [sys.executable, "-m", "tandem.cli", "serve", "--device", "cpu"]
        argv += ["--port", str(self.port), "--worker-port-base", str(self.worker_port)]
        argv += ["--kv-port-base", str(kv_port), "--stop-timeout", "5", *args]
        env = dict(env if env is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join((str(fake_tandem), str(SRC), str(TESTS)))
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


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def wait_until_gone(pids: list[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


@pytest.fixture
def launch(fake_tandem: Path) -> Iterator[type[Launcher]]:
    launchers: list[Launcher] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Launcher:
        launcher = Launcher(fake_tandem, *args, env=env)
        launchers.append(launcher)
        return launcher

    yield start  # type: ignore[misc]
    for launcher in launchers:
        children = launcher.children() if launcher.process.poll() is None else []
        launcher.stop()
        for pid in children:
            if alive(pid):
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


def assert_decode_worker_back(launcher: Launcher) -> None:
    """decode-0, restarted once, is healthy again, back in the router's pool, and serves."""
    router_url = f"http://127.0.0.1:{launcher.port}"
    decode_url = f"http://127.0.0.1:{launcher.worker_port + 1}"
    launcher.wait_for_line("decode-0 is healthy again (restart 1)", timeout=30)
    deadline = time.monotonic() + 10  # the router's next health round takes it back
    while httpx.get(router_url + "/health").json()["workers"]["decode"] != 1:
        assert time.monotonic() < deadline, "the router did not take the worker back"
        time.sleep(0.1)
    body = {"model": "smollm2-135m-instruct", "prompt": "hello world", "max_tokens": 3}
    answer = httpx.post(router_url + "/v1/completions", json=body).json()
    assert answer["choices"][0]["text"] == " hello world hello"
    assert httpx.get(decode_url + "/fake/stats").json()["requests"]  # the new decode worker's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_crashed_worker_is_restarted_and_the_cluster_stays_up(launch):
    """A worker that exits (as one the OOM killer took) comes back on its ports; the launcher
    keeps running (it used to stop the whole cluster) and Ctrl-C still stops everything."""
    launcher = launch()
    launcher.wait_for_line("ready at")
    decode_url = f"http://127.0.0.1:{launcher.worker_port + 1}"
    httpx.post(decode_url + "/fake/control", json={"exit": 3})
    line = launcher.wait_for_line("exited with code", timeout=10)
    assert line.endswith("decode-0 exited with code 3; restarting in 1 s (restart 1)\n")
    assert_decode_worker_back(launcher)
    children = launcher.children()
    assert launcher.process.poll() is None and len(children) == 3

    launcher.process.send_signal(signal.SIGINT)
    assert launcher.process.wait(timeout=15) == 0
    wait_until_gone(children, timeout=5)


@pytest.mark.slow  # 11 s; by default the supervisor's own test of the same restart (fake_cluster)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_worker_is_killed_and_restarted(launch):
    """A worker that stops answering (SIGSTOP, as a deadlocked or swapped-out one) is killed
    once it has answered no health check for --unresponsive-timeout, and started again."""
    launcher = launch("--unresponsive-timeout", "2")
    launcher.wait_for_line("ready at")
    (stopped,) = [
        pid for pid in launcher.children() if f"--port {launcher.worker_port + 1} " in cmdline(pid)
    ]
    os.kill(stopped, signal.SIGSTOP)
    line = launcher.wait_for_line("answered no health check", timeout=15)
    assert line.endswith(
        "decode-0 answered no health check for 2 s; restarting in 1 s (restart 1)\n"
    )
    wait_until_gone([stopped], timeout=5)
    assert_decode_worker_back(launcher)
    assert launcher.process.poll() is None and len(launcher.children()) == 3


@pytest.mark.slow  # 16 s; by default the supervisor's own test of the same line (fake_cluster)
def test_a_worker_that_cannot_start_is_named(launch, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "roles:\n"
        "  prefill: {count: 1, engine: {kv_transport: tcp, extra_args: [--no-such-flag]}}\n"
        "  decode: {count: 1, engine: {kv_transport: tcp}}\n"
    )
    launcher = launch("--config", str(config), "--max-start-failures", "2")
    line = launcher.wait_for_line("prefill-0 exited", timeout=30)
    assert line.endswith("prefill-0 exited with code 2; restarting in 1 s (restart 1)\n")
    line = launcher.wait_for_line("did not start", timeout=30)
    assert line.endswith(
        f"prefill-0 (http://127.0.0.1:{launcher.worker_port}) failed to start 2 times in a row, "
        "the last time: exited with code 2; stopping everything\n"
    )
    assert launcher.process.wait(timeout=15) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("flag", "from_env"), [("flag-token", None), (None, "env-token"), ("flag-token", "env-token")]
)
def test_the_cluster_token_reaches_every_child_in_its_environment(launch, flag, from_env):
    """From --cluster-token, else TANDEM_CLUSTER_TOKEN; never on a child's command line."""
    env = {key: value for key, value in os.environ.items() if key != CLUSTER_TOKEN_ENV}
    if from_env is not None:
        env[CLUSTER_TOKEN_ENV] = from_env
    launcher = launch(*(("--cluster-token", flag) if flag else ()), env=env)
    launcher.wait_for_line("ready at")
    children = launcher.children()
    assert len(children) == 3
    expected = f"{CLUSTER_TOKEN_ENV}={flag or from_env}".encode()
    for pid in children:
        assert expected in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert (flag or from_env).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_without_a_cluster_token_one_is_made_and_shared(launch):
    env = {key: value for key, value in os.environ.items() if key != CLUSTER_TOKEN_ENV}
    launcher = launch(env=env)
    launcher.wait_for_line("the cluster token is a fresh random one")
    launcher.wait_for_line("ready at")
    children = launcher.children()
    tokens = set()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        tokens |= {entry for entry in environ if entry.startswith(f"{CLUSTER_TOKEN_ENV}=".encode())}
        assert b"--cluster-token" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert len(children) == 3 and len(tokens) == 1
    token = tokens.pop().split(b"=", 1)[1]
    assert len(token) == 43  # 32 random bytes, base64url
    assert token not in "".join(launcher.output).encode()  # never printed


# ---- the supervisor over fake children -------------------------------------------------------

# argv: port, a file each start appends its pid to, one behaviour per start (the last repeats),
# the /health body. fail: exit 2 at once; hang: never listen; crash: answer /health once, then
# exit 3; serve: answer /health; linger: serve, and exit 0.5 s after SIGTERM. Every child writes
# the time a SIGTERM reached it to its starts file + ".terms".
FAKE_CHILD = """
import http.server, os, signal, sys, threading, time
port, starts_file, behaviours, body = sys.argv[1:]
with open(starts_file, "a+") as starts:
    starts.seek(0)
    start = len(starts.read().split())
    starts.write(f"{os.getpid()}\\n")
behaviour = behaviours.split(",")[min(start, behaviours.count(","))]
if behaviour == "fail":
    sys.exit(2)
def on_term(*_):
    with open(starts_file + ".terms", "a") as terms:
        terms.write(f"{time.time()}\\n")
    time.sleep(0.5 if behaviour == "linger" else 0)
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
if behaviour == "hang":
    time.sleep(60)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())
        if behaviour == "crash":
            threading.Timer(0.05, os._exit, (3,)).start()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), Health).serve_forever()
"""


class FakeCluster:
    """A Supervisor over fake children, supervising in a thread; `starts[name]` lists the
    pids of a child's starts."""

    def __init__(
        self,
        tmp_path: Path,
        children: dict[str, str],
        router_body: str,
        router: str = "serve",
        **options,
    ):
        plans = []
        self.starts_files = {}
        for name, behaviours in {**children, "router": router}.items():
            port = free_port_block(1)
            self.starts_files[name] = tmp_path / f"{name}.starts"
            body = router_body if name == "router" else "{}"
            argv = (sys.executable, "-c", FAKE_CHILD, str(port), str(self.starts_files[name]))
            role = name.rsplit("-", 1)[0]
            url = f"http://127.0.0.1:{port}"
            plans.append(ProcessPlan(name, (*argv, behaviours, body), url, role))
        self.out = io.StringIO()
        options = dict(startup_timeout_s=30, stop_timeout_s=5, initial_backoff_s=0.1) | options
        self.supervisor = Supervisor(plans, out=self.out, **options)
        self.status: list[int] = []
        self.thread = threading.Thread(
            target=lambda: self.status.append(self.supervisor.supervise())
        )
        self.thread.start()

    def lines(self) -> list[str]:
        return [line.removeprefix("tandem serve: ") for line in self.out.getvalue().splitlines()]

    def wait_for_line(self, text: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines()):
            assert time.monotonic() < deadline, f"no {text!r} line in {self.lines()}"
            time.sleep(0.05)

    def starts(self, name: str) -> list[int]:
        path = self.starts_files[name]
        return [int(pid) for pid in path.read_text().split()] if path.exists() else []

    def all_pids(self) -> list[int]:
        return [pid for name in self.starts_files for pid in self.starts(name)]

    def finish(self, stop: bool = True, timeout: float = 20) -> int:
        """The supervisor's exit status, once it returned (after `stop`, or by itself);
        every child is gone by then."""
        if stop:
            self.supervisor.stop()
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), "the supervisor did not return"
        wait_until_gone(self.all_pids(), timeout=5)
        return self.status[0]


@pytest.fixture
def fake_cluster(tmp_path: Path) -> Iterator[type[FakeCluster]]:
    clusters: list[FakeCluster] = []

    def start(*args, **kwargs) -> FakeCluster:
        cluster = FakeCluster(tmp_path, *args, **kwargs)
        clusters.append(cluster)
        return cluster

    yield start  # type: ignore[misc]
    for cluster in clusters:
        if cluster.thread.is_alive():
            cluster.supervisor.stop()
            cluster.supervisor.stop()  # kill at once
            cluster.thread.join(timeout=10)


ONE_BOTH = '{"workers": {"prefill": 0, "decode": 0, "both": 1}}'


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("backoff_reset_s", "delays"),
    [(60.0, ["0.1", "0.2", "0.25", "0.25"]), (0.0, ["0.1", "0.1", "0.2", "0.1"])],
)
def test_exits_are_restarted_with_backoff_and_failed_starts_count_in_a_row(
    fake_cluster, backoff_reset_s, delays
):
    """The backoff doubles up to its ceiling, and starts over after a long enough healthy run
    (any, with 0 s; a failed start is none). Two failed starts stop the cluster only when in a
    row, and none is here: a healthy start between them resets the count."""
    cluster = fake_cluster(
        {"both-0": "fail,crash,fail,crash,serve"},
        ONE_BOTH,
        max_start_failures=2,
        max_backoff_s=0.25,
        backoff_reset_s=backoff_reset_s,
    )
    cluster.wait_for_line("both-0 is healthy again (restart 4)")
    codes = [2, 3, 2, 3]
    expected = [
        f"both-0 exited with code {code}; restarting in {delay} s (restart {restart})"
        for restart, (code, delay) in enumerate(zip(codes, delays, strict=True), start=1)
    ]
    restarts = [line for line in cluster.lines() if "restarting in" in line]
    assert restarts == expected
    assert sum("ready at" in line for line in cluster.lines()) == 1
    assert len(cluster.starts("both-0")) == 5 and len(cluster.starts("router")) == 1
    assert cluster.finish() == 0
    assert cluster.lines()[-1] == "stopping"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_that_fails_to_start_n_times_in_a_row_stops_the_cluster(fake_cluster):
    cluster = fake_cluster({"both-0": "fail"}, ONE_BOTH, max_start_failures=3)
    assert cluster.finish(stop=False) == 1
    url = cluster.supervisor.children[0].plan.url
    assert cluster.lines()[-1] == (
        f"the cluster did not start: both-0 ({url}) failed to start 3 times in a row, the last "
        "time: exited with code 2; stopping everything"
    )
    assert len(cluster.starts("both-0")) == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_never_healthy_is_killed_and_counts_as_a_failed_start(fake_cluster):
    cluster = fake_cluster(
        {"both-0": "hang"}, ONE_BOTH, max_start_failures=2, startup_timeout_s=0.5
    )
    assert cluster.finish(stop=False) == 1
    assert (
        cluster.lines()[-2] == "both-0 was not healthy after 0.5 s; restarting in 0.1 s (restart 1)"
    )
    assert (
        "failed to start 2 times in a row, the last time: was not healthy after 0.5 s"
        in (cluster.lines()[-1])
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_that_stops_answering_is_killed_and_restarted(fake_cluster):
    """Healthy, then stopped: killed after unresponsive_timeout_s without an answer, and
    restarted as after an exit (not a failed start: the cluster stays up)."""
    cluster = fake_cluster({"both-0": "serve"}, ONE_BOTH, unresponsive_timeout_s=1.0)
    cluster.wait_for_line("ready at")
    (first,) = cluster.starts("both-0")
    os.kill(first, signal.SIGSTOP)
    cluster.wait_for_line("both-0 is healthy again (restart 1)")
    assert "both-0 answered no health check for 1 s; restarting in 0.1 s (restart 1)" in (
        cluster.lines()
    )
    assert not alive(first) and len(cluster.starts("both-0")) == 2
    assert len(cluster.starts("router")) == 1
    time.sleep(2.0)  # a child that goes on answering is left alone
    assert len(cluster.starts("both-0")) == 2
    assert cluster.finish() == 0


@pytest.mark.parametrize(
    ("router_body", "ready"),
    [
        ('{"workers": {"prefill": 1, "decode": 2, "both": 0}}', True),  # one decode by hand
        ('{"workers": {"prefill": 1, "decode": 0, "both": 1}}', False),  # decode-0 is missing
    ],
)
def test_readiness_wants_at_least_the_workers_started(fake_cluster, router_body, ready):
    """A worker registered by hand in the router's pool does not keep the launcher from
    reporting ready (it waited for the pool to equal what it started)."""
    cluster = fake_cluster({"prefill-0": "serve", "decode-0": "serve"}, router_body)
    deadline = time.monotonic() + 20
    while any(child.healthy_since is None for child in cluster.supervisor.children):
        assert time.monotonic() < deadline, cluster.lines()
        time.sleep(0.05)
    time.sleep(1.0)  # several rounds of the readiness check
    assert any("ready at" in line for line in cluster.lines()) == ready
    assert cluster.finish() == 0


def test_the_router_stops_first_and_the_workers_once_it_exited(fake_cluster):
    """What the router still streams finishes on workers that still serve: SIGTERM reaches the
    workers only once the router (which takes 0.5 s to stop here) has exited."""
    cluster = fake_cluster({"both-0": "serve"}, ONE_BOTH, router="linger")
    cluster.wait_for_line("ready at")
    assert cluster.finish() == 0

    def terms(name: str) -> list[float]:
        return [float(t) for t in Path(f"{cluster.starts_files[name]}.terms").read_text().split()]

    (router_term,) = terms("router")
    (worker_term,) = terms("both-0")
    assert worker_term >= router_term + 0.5
