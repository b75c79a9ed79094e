"""PD across two network namespaces joined by a veth pair: a real network path, not loopback.

    namespace A: prefill worker, HTTP and KV server on 10.78.0.1
    namespace B: decode worker on B's own 127.0.0.1, and the test client (run inside B), which
                 reaches the prefill worker over the veth link

The client runs prompts through both legs and the same prompts whole (no PD) on the prefill
worker; the answers must be token-identical and both workers must end holding nothing. Once per
KV transport that crosses hosts: tcp, nixl (UCX over TCP) and mooncake (its TCP protocol), the
last two where their library is installed. Skipped where network namespaces cannot be made (no
iproute2, no privilege).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.kv.data import installed

CHECKPOINT = "qwen3-qknorm"
PREFILL_ADDRESS, DECODE_ADDRESS = "10.78.0.1", "10.78.0.2"
PREFILL_PORT, DECODE_PORT = 8000, 8001

CLIENT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import httpx
    from pd_fixtures import (
        assert_nothing_held, metric, prompt_set, run_direct, run_pd, wait_until)

    prefill_url, decode_url = sys.argv[1], sys.argv[2]

    def healthy(url):
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    for url in (prefill_url, decode_url):
        wait_until(lambda: healthy(url), 120, f"{url} did not become healthy")
    results = []
    with httpx.Client() as client:
        for index, prompt in enumerate(prompt_set(1000, 1, 512)[::3]):
            body = {"prompt": prompt, "max_tokens": 8, "stream": index % 2 == 1}
            body.update({"temperature": 0.0} if index % 3 else {"temperature": 0.8, "seed": 5})
            pd = run_pd(client, prefill_url, decode_url, "/v1/completions", body)
            whole = run_direct(client, prefill_url, "/v1/completions", body)
            results.append([pd.token_ids, whole.token_ids])
    assert_nothing_held(prefill_url, decode_url, timeout=10)
    received = metric(decode_url, "tandem_kv_transfer_blocks_received")
    print(json.dumps({"results": results, "blocks_received": received}))
    """
)


def run_ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@contextlib.contextmanager
def namespaces_joined_by_veth():
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    pid = os.getpid()
    names = (f"tpd-a-{pid}", f"tpd-b-{pid}")
    created = run_ip("netns", "add", names[0])
    if created.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here: {created.stderr.strip()}")
    try:
        link_a, link_b = f"tpda{pid}", f"tpdb{pid}"
        for step in [
            ("netns", "add", names[1]),
            ("link", "add", link_a, "netns", names[0], "type", "veth",
             "peer", "name", link_b, "netns", names[1]),
            ("-n", names[0], "addr", "add", f"{PREFILL_ADDRESS}/24", "dev", link_a),
            ("-n", names[1], "addr", "add", f"{DECODE_ADDRESS}/24", "dev", link_b),
            ("-n", names[0], "link", "set", link_a, "up"),
            ("-n", names[1], "link", "set", link_b, "up"),
            ("-n", names[0], "link", "set", "lo", "up"),
            ("-n", names[1], "link", "set", "lo", "up"),
        ]:  # fmt: skip
            result = run_ip(*step)
            assert result.returncode == 0, f"ip {' '.join(step)}: {result.stderr}"
        yield names
    finally:
        for name in names:
            run_ip("netns", "del", name)


def start_in_namespace(namespace: str, command: list[str], log_path: Path, env: dict):
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            ["ip", "netns", "exec", namespace, *command],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def needs(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not installed(name), reason=f"{name} missing")


# By default nixl's case: tcp's (22 s) and mooncake's (45 s) cross the loopback in
# test_pd_tiny.py and test_kv_library_planes.py by default, and a namespace here when slow.
TRANSPORTS = [
    pytest.param("tcp", marks=pytest.mark.slow),
    pytest.param("nixl", marks=needs("nixl")),
    pytest.param("mooncake", marks=[needs("mooncake"), pytest.mark.slow]),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pd_between_network_namespaces(tiny_checkpoints, tmp_path: Path, transport: str):
    tests_dir = Path(__file__).resolve().parent
    source_dir = tests_dir.parent / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source_dir), str(tests_dir)]))
    env.setdefault("UCX_TLS", "tcp")  # no RDMA here: NIXL's UCX over the veth link
    worker = [sys.executable, "-m", "tandem.cli", "worker", "--model"]
    worker += [str(tiny_checkpoints[CHECKPOINT]), "--num-kv-blocks", "512"]
    worker += ["--kv-transport", transport]
    prefill_flags = ["--role", "prefill", "--host", PREFILL_ADDRESS, "--port", str(PREFILL_PORT)]
    decode_flags = ["--role", "decode", "--host", "127.0.0.1", "--port", str(DECODE_PORT)]
    with namespaces_joined_by_veth() as (prefill_ns, decode_ns):
        processes = [
            start_in_namespace(prefill_ns, worker + prefill_flags, tmp_path / "prefill.log", env),
            start_in_namespace(decode_ns, worker + decode_flags, tmp_path / "decode.log", env),
        ]
        try:
            client = subprocess.run(
                ["ip", "netns", "exec", decode_ns, sys.executable, "-c", CLIENT_SCRIPT,
                 f"http://{PREFILL_ADDRESS}:{PREFILL_PORT}", f"http://127.0.0.1:{DECODE_PORT}"],
                capture_output=True, text=True, env=env, timeout=240,
            )  # fmt: skip
        finally:
            for process in processes:
                stop(process)
        logs = "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log")))
        assert client.returncode == 0, f"{client.stderr[-3000:]}\n{logs}"
    report = json.loads(client.stdout.strip().splitlines()[-1])
    assert len(report["results"]) == 6
    for pd_token_ids, whole_token_ids in report["results"]:
        assert pd_token_ids == whole_token_ids and len(pd_token_ids) == 8
    assert report["blocks_received"] > 0
