"""`tandem serve --ray`: the placement planned without Ray (bundles, the KV transport picked by
where the workers landed, each process's command line on its node, the cluster file's `ray:`
section), and a real Ray cluster of two nodes on this host (`ray.cluster_utils.Cluster`, told
apart by custom resources) running 1 prefill worker on one node and 2 decode workers on the other
from a tiny random checkpoint: the openai client's answers against a colocated worker's, a decode
worker's actor killed mid-stream (clean errors, the worker back), Ctrl-C leaving no actor and no
process. Without Ray importable, `--ray` names the pip install to run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from process_tree import SRC, alive, children_of, descendants, tandem_process
from tandem.launcher.cli import add_parser, cluster_data
from tandem.launcher.cluster import ClusterError, parse_cluster
from tandem.launcher.plan import plan_processes
from tandem.launcher.ray_cluster import (
    STRATEGIES,
    HostInfo,
    bundle_of,
    kv_transport_on_ray,
    placed_argv,
    placed_url,
    ray_device,
    with_kv_transport,
)
from worker_fixtures import free_port_block, read_metrics, start_worker

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def two_roles(prefill: dict, decode: dict, **top) -> dict:
    engine = {"kv_transport": "auto"}
    return {
        "model": "m",
        "roles": {
            "prefill": {"count": 1, "engine": {**engine, **prefill}},
            "decode": {"count": 2, "engine": {**engine, **decode}},
        },
        **top,
    }


def host(node: str, gpus: tuple[int, ...] = (), nixl: bool = False) -> HostInfo:
    return HostInfo(node, f"10.0.0.{node[-1]}", gpus, f"/opt/{node}/python", nixl)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


# ---- planning, no Ray -------------------------------------------------------------------------


def test_bundles_follow_each_roles_gpus_and_nodes():
    data = two_roles(
        {"tensor_parallel_size": 2},
        {},
        ray={"placement": "spread", "nodes": {"prefill": {"node_a": 1}, "decode": {"node_b": 1}}},
    )
    spec = parse_cluster(data)
    plans = plan_processes(spec, "cuda", 4)
    assert [plan.name for plan in plans] == ["prefill-0", "decode-0", "decode-1", "router"]
    assert [bundle_of(spec, plan, "cuda") for plan in plans] == [
        {"CPU": 2.0, "GPU": 2.0, "node_a": 1},
        {"CPU": 1.0, "GPU": 1.0, "node_b": 1},
        {"CPU": 1.0, "GPU": 1.0, "node_b": 1},
        {"CPU": 1.0},
    ]
    cpu_bundles = [bundle_of(spec, plan, "cpu") for plan in plan_processes(spec, "cpu", 0)]
    assert [bundle.get("GPU") for bundle in cpu_bundles] == [None] * 4
    pd = parse_cluster({"model": "m", "roles": {"pd": {"count": 1}}, "ray": {}})
    assert bundle_of(pd, plan_processes(pd, "cuda", 2)[0], "cuda") == {"CPU": 2.0, "GPU": 2.0}
    assert (ray_device("auto", 2), ray_device("auto", 0), ray_device("cpu", 2)) == (
        "cuda",
        "cpu",
        "cpu",
    )
    with pytest.raises(ClusterError, match="the Ray cluster has no GPU"):
        ray_device("cuda", 0)
    assert (spec.ray.placement, STRATEGIES["spread"], STRATEGIES["pack"]) == (
        "spread",
        "SPREAD",
        "PACK",
    )


def test_the_kv_transport_follows_where_the_workers_landed():
    spec = parse_cluster(two_roles({}, {}))
    a, b = host("node-1", (0,), nixl=True), host("node-2", (0,), nixl=True)
    assert kv_transport_on_ray(spec, "cuda", [a, a, a]) == "cuda-ipc"
    assert kv_transport_on_ray(spec, "cuda", [a, b, b]) == "nixl"
    assert kv_transport_on_ray(spec, "cuda", [a, b, host("node-2", (1,))]) == "tcp"
    assert kv_transport_on_ray(spec, "cpu", [a, b, b]) == "tcp"
    assert kv_transport_on_ray(spec, "cpu", [a, a, a]) == "tcp"
    tensor_parallel = parse_cluster(two_roles({}, {"tensor_parallel_size": 2}))  # as any other
    assert kv_transport_on_ray(tensor_parallel, "cuda", [a, a, a]) == "cuda-ipc"
    assert kv_transport_on_ray(tensor_parallel, "cuda", [a, b, b]) == "nixl"

    # `auto` becomes the pick in every worker's command line; a transport the file names stays
    for transport in ("nixl", "cuda-ipc"):
        plans = plan_processes(with_kv_transport(spec, transport), "cuda", 4)
        assert [flag(list(p.argv), "--kv-transport") for p in plans[:-1]] == [transport] * 3
    named = parse_cluster(two_roles({"kv_transport": "tcp"}, {"kv_transport": "tcp"}))
    plans = plan_processes(with_kv_transport(named, "nixl"), "cuda", 4)
    assert {flag(list(p.argv), "--kv-transport") for p in plans[:-1]} == {"tcp"}


def test_each_command_line_is_placed_on_its_node():
    spec = parse_cluster(two_roles({"tensor_parallel_size": 2}, {}))
    prefill, decode, _, router = plan_processes(spec, "cuda", 4)
    router_url = "http://10.0.0.9:8000"

    argv = placed_argv(prefill, host("node-1", (2, 3)), router_url)
    assert argv[0] == "/opt/node-1/python" and argv[1:4] == ["-m", "tandem.cli", "worker"]
    assert (flag(argv, "--host"), flag(argv, "--device")) == ("10.0.0.1", "cuda:2")
    assert argv[-2:] == ["--router", router_url]
    assert flag(argv, "--port") == flag(list(prefill.argv), "--port")
    assert placed_url(prefill, host("node-1")) == f"http://10.0.0.1:{flag(argv, '--port')}"
    with pytest.raises(RuntimeError, match="not consecutive"):
        placed_argv(prefill, host("node-1", (0, 2)), router_url)
    assert flag(placed_argv(decode, host("node-2", (0,)), router_url), "--device") == "cuda:0"

    placed = placed_argv(router, host("node-3"), router_url)
    assert flag(placed, "--host") == "10.0.0.3" and "--router" not in placed
    assert not {"--prefill", "--decode", "--worker", "--auto"} & set(placed)
    assert not [arg for arg in placed if arg.startswith("http://")]
    assert [arg for arg in router.argv if arg.startswith("http://")]  # planned: static URLs
    everywhere = parse_cluster(two_roles({}, {}, router={"host": "0.0.0.0"}))
    router = plan_processes(everywhere, "cpu", 0)[-1]
    assert flag(placed_argv(router, host("node-3"), router_url), "--host") == "0.0.0.0"

    pd = parse_cluster({"model": "m", "roles": {"pd": {"count": 1}}})
    argv = placed_argv(plan_processes(pd, "cuda", 2)[0], host("node-1", (4, 5)), router_url)
    assert (flag(argv, "--device"), flag(argv, "--decode-device")) == ("cuda:4", "cuda:5")


def test_the_cluster_files_ray_section():
    given = serve_args("--ray", "10.0.0.1:6379", "--model", "m")
    assert parse_cluster(cluster_data(given)).ray.address == "10.0.0.1:6379"
    assert parse_cluster(cluster_data(serve_args("--model", "m"))).ray is None
    assert serve_args("--ray").ray == ""  # on Ray, at the file's (or Ray's default) address
    with pytest.raises(ClusterError, match="ray.nodes.decode asks for 1 GPU; it names custom"):
        parse_cluster(two_roles({}, {}, ray={"nodes": {"decode": {"GPU": 1}}}))
    with pytest.raises(ClusterError, match="ray.placement"):
        parse_cluster(two_roles({}, {}, ray={"placement": "diagonal"}))
    with pytest.raises(ClusterError, match="ray.nodes"):
        parse_cluster(two_roles({}, {}, ray={"nodes": {"planner": {"node_a": 1}}}))


def test_without_ray_the_flag_names_the_install(tmp_path):
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no ray here')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{SRC}")
    answer = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--device", "cpu", "--ray"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer.returncode == 2, answer.stderr
    assert "pip install 'tandem[ray]'" in answer.stderr.strip().splitlines()[-1]


# ---- a real Ray cluster of two nodes ----------------------------------------------------------


def wait_until(condition, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    tail = log.read_text(errors="replace")[-4000:] if log else ""
    raise AssertionError(f"{what} did not happen within {timeout} s\n{tail}")


def actors(address: str) -> dict[str, object]:
    """The ALIVE actors of the Ray cluster by their repr (the process each hosts)."""
    from ray.util.state import list_actors

    found = list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True)
    return {actor.repr_name: actor for actor in found}


@pytest.fixture(scope="module")
def ray_nodes():
    """Two Ray nodes on this host: node_a and node_b, told apart by a custom resource."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"node_a": 4}}
    )
    try:
        cluster.add_node(num_cpus=4, resources={"node_b": 4})
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def served(ray_nodes, tiny_checkpoints, tmp_path_factory):
    """`tandem serve --ray` with the prefill worker on node_a and both decode workers on
    node_b, and a colocated worker to compare with."""
    logs = tmp_path_factory.mktemp("ray-serve")
    model = str(tiny_checkpoints["llama-gqa"])
    cluster_file = logs / "cluster.yaml"
    decode_engine = {"kv_transport": "auto", "max_num_seqs": 1}  # streams queue: one is cut
    cluster_file.write_text(
        yaml.safe_dump(
            {
                "model": model,
                "device": "cpu",
                "roles": {
                    "prefill": {"count": 1, "engine": {"kv_transport": "auto"}},
                    "decode": {"count": 2, "engine": decode_engine},
                },
                "ray": {
                    "placement": "spread",
                    "nodes": {"prefill": {"node_a": 1}, "decode": {"node_b": 1}},
                },
            }
        )
    )
    port = free_port_block(8)  # the router's, 3 workers', 3 KV listeners', the colocated's
    worker_ports, kv_ports, reference_port = port + 1, port + 4, port + 7
    launcher = tandem_process(
        logs / "serve.log", "serve", "--config", str(cluster_file), "--ray", ray_nodes.address,
        "--port", str(port), "--worker-port-base", str(worker_ports),
        "--kv-port-base", str(kv_ports), "--unresponsive-timeout", "10",
    )  # fmt: skip
    reference = start_worker(logs, "--role", "both", model=model, port=reference_port)
    log = logs / "serve.log"

    def ready() -> bool:
        assert launcher.poll() is None, f"tandem serve exited:\n{log.read_text()[-4000:]}"
        return "tandem serve: ready at" in log.read_text()

    try:
        wait_until(ready, 400, "ready", log)
        url = log.read_text().split("tandem serve: ready at ", 1)[1].split()[0].removesuffix("/v1")
        reference.wait_healthy()
        yield {"url": url, "launcher": launcher, "log": log, "reference": reference}
    finally:
        reference.stop()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_openai_client_through_ray_matches_colocated(served, ray_nodes):
    placed = actors(ray_nodes.address)
    assert set(placed) == {"prefill-0", "decode-0", "decode-1", "router"}
    assert placed["decode-0"].node_id == placed["decode-1"].node_id != placed["prefill-0"].node_id
    assert "cpu workers on 2 node(s); KV: tcp" in served["log"].read_text()

    pd = openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused")
    both = openai.OpenAI(base_url=served["reference"].url + "/v1", api_key="unused")
    for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 7}):
        body = dict(model=pd.models.list().data[0].id, prompt=PROMPT, max_tokens=12, **sampling)
        extra = {"extra_body": {"return_token_ids": True}}
        expected = both.completions.create(**body, **extra).choices[0].token_ids
        assert len(expected) == 12
        assert pd.completions.create(**body, **extra).choices[0].token_ids == expected
        chunks = pd.completions.create(**body, **extra, stream=True)
        streamed = [
            token for chunk in chunks if chunk.choices for token in chunk.choices[0].token_ids
        ]
        assert streamed == expected


def hosted_worker(actor) -> tuple[int, str]:
    """The pid and URL of the worker process an actor hosts."""
    (pid,) = children_of(actor.pid)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return pid, f"http://{flag(argv, '--host')}:{flag(argv, '--port')}"


def times_healthy_again(log: Path, name: str) -> int:
    return log.read_text().count(f"tandem serve: {name} is healthy again")


@pytest.mark.slow  # 30 s; the launcher's restart is tested without Ray by default
def test_a_decode_workers_actor_killed_mid_stream(served, ray_nodes):
    """SIGKILL the actor of a decode worker that is streaming: the worker dies with its actor,
    its streams end with an error event (none hangs), Ray restarts the actor, the launcher
    starts the worker again, and the router answers through it."""
    url, log = served["url"], served["log"]
    placed = actors(ray_nodes.address)
    decodes = {name: hosted_worker(placed[name])[1] for name in ("decode-0", "decode-1")}
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    events: list[list] = [[] for _ in range(4)]

    def read(index: int) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events[index].append(data if data == "[DONE]" else json.loads(data))

    def streaming_decode() -> str | None:
        for name, worker_url in decodes.items():
            if read_metrics(worker_url).get("tandem_requests_running", 0) >= 1:
                return name
        return None

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(events))]
    for reader in readers:
        reader.start()
    wait_until(lambda: streaming_decode() is not None, 120, "a stream on a decode worker")
    victim = streaming_decode()
    decode = placed[victim]
    old_worker = descendants(decode.pid)
    healthy_again = times_healthy_again(log, victim)
    os.kill(decode.pid, signal.SIGKILL)
    for reader in readers:
        reader.join(timeout=120)
    assert not any(reader.is_alive() for reader in readers), "a stream hung"
    finished = [s for s in events if s[-2].get("choices", [{}])[0].get("finish_reason")]
    cut = [stream for stream in events if stream not in finished]
    assert cut, "every stream finished before the kill; nothing was tested"
    assert all(stream[-1] == "[DONE]" and "error" in stream[-2] for stream in cut)
    wait_until(lambda: not any(alive(pid) for pid in old_worker), 30, "the old worker's end")

    wait_until(lambda: f"{victim} lost its actor" in log.read_text(), 60, "the restart line", log)
    back = lambda: times_healthy_again(log, victim) > healthy_again  # noqa: E731
    wait_until(back, 300, f"{victim} coming back", log)
    in_pool = lambda: httpx.get(f"{url}/health").json()["workers"]["decode"] == 2  # noqa: E731
    wait_until(in_pool, 60, f"the router taking {victim} back", log)
    answer = httpx.post(
        f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    assert actors(ray_nodes.address)[victim].pid != decode.pid


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "why"),
    [
        (signal.SIGKILL, "exited with code -9"),  # as the OOM killer would have it
        (signal.SIGSTOP, "answered no health check for 10 s"),  # --unresponsive-timeout
    ],
    ids=["killed", "stopped"],
)
def test_a_worker_process_killed_or_stopped_comes_back_under_its_actor(
    served, ray_nodes, signum, why
):
    """The worker process dies, or stops answering, not its actor: the launcher has the actor
    end it and start it again, and the router takes it back."""
    url, log = served["url"], served["log"]
    decode = actors(ray_nodes.address)["decode-1"]
    worker, _ = hosted_worker(decode)
    healthy_again = times_healthy_again(log, "decode-1")
    os.kill(worker, signum)
    restarting = f"decode-1 {why}; restarting in"
    wait_until(lambda: restarting in log.read_text(), 60, "the restart line", log)
    wait_until(lambda: not alive(worker), 10, "the old worker's end", log)
    back = lambda: times_healthy_again(log, "decode-1") > healthy_again  # noqa: E731
    wait_until(back, 300, "decode-1 coming back", log)
    in_pool = lambda: httpx.get(f"{url}/health").json()["workers"]["decode"] == 2  # noqa: E731
    wait_until(in_pool, 60, "the router taking decode-1 back", log)
    assert actors(ray_nodes.address)["decode-1"].pid == decode.pid


def test_ctrl_c_leaves_no_actor_and_no_process(served, ray_nodes):
    launcher = served["launcher"]
    hosted = {pid for actor in actors(ray_nodes.address).values() for pid in descendants(actor.pid)}
    assert len(hosted) >= 7  # the router, three workers and their engine cores
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=120) == 0
    assert "tandem serve: stopping" in served["log"].read_text()
    wait_until(lambda: not actors(ray_nodes.address), 60, "every actor's end")
    wait_until(lambda: not any(alive(pid) for pid in hosted), 30, "every process's end")
