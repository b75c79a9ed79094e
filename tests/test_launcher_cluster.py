"""Cluster descriptions: parsing, the refusals of inconsistent ones, and the commands planned."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from tandem.access import CLUSTER_TOKEN_ENV
from tandem.launcher.cli import DEFAULT_CLUSTER, add_parser, cluster_overrides, run
from tandem.launcher.cluster import (
    ClusterError,
    load_cluster_file,
    merge_overrides,
    parse_cluster,
)
from tandem.launcher.plan import child_environment, expected_router_counts, plan_processes
from tandem.router.cli import add_parser as add_router_parser
from tandem.server.cli import add_parser as add_worker_parser
from tandem.server.reasoning import REASONING_PARSERS
from tandem.server.tool_calls import TOOL_CALL_PARSERS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cluster.yaml"

PD_ROLES = """
roles:
  prefill: {count: 1, engine: {block_size: 16, kv_transport: tcp}}
  decode: {count: 1, engine: {block_size: 16, kv_transport: tcp}}
"""


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_the_example_file_describes_one_prefill_and_one_decode_worker():
    spec = parse_cluster(load_cluster_file(EXAMPLE), str(EXAMPLE))
    assert (spec.roles.prefill.count, spec.roles.decode.count, spec.roles.both.count) == (1, 1, 0)
    assert spec.model == "smollm2-135m-instruct"
    assert spec.engine_of("decode").worker_flags() == [
        "--block-size",
        "16",
        "--max-num-seqs",
        "64",
        "--kv-transport",
        "tcp",
    ]
    assert (spec.ports.router, spec.worker_port_base, spec.kv_port_base) == (8000, 8100, 8200)


def test_flags_override_the_defaults_and_the_file():
    args = serve_args("--prefill", "2", "--port", "9000", "--model", "m", "--device", "cpu")
    spec = parse_cluster(merge_overrides(DEFAULT_CLUSTER, cluster_overrides(args)))
    assert (spec.roles.prefill.count, spec.roles.decode.count) == (2, 1)
    assert (spec.model, spec.device, spec.ports.router, spec.worker_port_base) == (
        "m",
        "cpu",
        9000,
        9100,
    )
    assert spec.engine_of("prefill").kv_transport == "auto"
    assert DEFAULT_CLUSTER["roles"]["prefill"]["count"] == 1  # the defaults were not modified

    data = yaml.safe_load(EXAMPLE.read_text())
    spec = parse_cluster(merge_overrides(data, cluster_overrides(serve_args("--decode", "3"))))
    assert spec.roles.decode.count == 3 and spec.roles.decode.engine.max_num_seqs == 64


@pytest.mark.parametrize("reasoning_parser", REASONING_PARSERS)  # each one the workers know
def test_the_reasoning_parser_reaches_every_worker(reasoning_parser):
    args = serve_args("--reasoning-parser", reasoning_parser, "--both", "1")
    spec = parse_cluster(merge_overrides(DEFAULT_CLUSTER, cluster_overrides(args)))
    for plan in plan_processes(spec, "cpu", num_gpus=0, python="py")[:-1]:
        flag = plan.argv.index("--reasoning-parser")
        assert plan.argv[flag + 1] == reasoning_parser, plan.name
    with pytest.raises(SystemExit):  # the worker's choices, refused as the flags are parsed
        serve_args("--reasoning-parser", "nope")


def test_the_chat_template_reaches_every_worker(tmp_path):
    """From the flag (a Jinja string) and from a cluster file (a file's path), as the worker's
    own --chat-template, which the worker's parser takes."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    spec = parse_cluster(
        merge_overrides(DEFAULT_CLUSTER, cluster_overrides(serve_args("--chat-template", template)))
    )
    template_file = tmp_path / "template.jinja"
    file_engine = {"chat_template": str(template_file)}
    file_spec = parse_cluster({"roles": {"pd": {"count": 1, "engine": file_engine}}})
    planned = [
        *((plan, template) for plan in plan_processes(spec, "cpu", num_gpus=0)[:-1]),
        *((plan, str(template_file)) for plan in plan_processes(file_spec, "cpu", num_gpus=0)[:-1]),
    ]
    assert [plan.name for plan, _ in planned] == ["prefill-0", "decode-0", "pd-0"]
    worker_parser = argparse.ArgumentParser()
    add_worker_parser(worker_parser.add_subparsers())
    for plan, expected in planned:
        command = plan.argv[plan.argv.index("worker") :]
        assert worker_parser.parse_args(command).chat_template == expected, plan.name


def test_engine_flags_reach_every_worker():
    """`tandem serve --max-model-len ...` as each worker's own flag (over a cluster file's),
    which the worker's parser takes; a value the worker would refuse is refused first."""
    flags = ["--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "32"]
    flags += ["--max-num-batched-tokens", "1024", "--gpu-memory-utilization", "0.8"]
    flags += ["--block-size", "32", "--num-kv-blocks", "500", "--scheduling-policy", "priority"]
    args = serve_args(*flags, "--both", "1")
    data = yaml.safe_load(EXAMPLE.read_text())  # its own max_num_seqs and block_size
    spec = parse_cluster(merge_overrides(data, cluster_overrides(args)))
    worker_parser = argparse.ArgumentParser()
    add_worker_parser(worker_parser.add_subparsers())
    expected = dict(
        dtype="bfloat16", max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=1024,
        gpu_memory_utilization=0.8, block_size=32, num_kv_blocks=500,
        scheduling_policy="priority",
    )  # fmt: skip
    workers = plan_processes(spec, "cpu", num_gpus=0)[:-1]
    assert [plan.name for plan in workers] == ["prefill-0", "decode-0", "both-0"]
    for plan in workers:
        parsed = vars(worker_parser.parse_args(plan.argv[plan.argv.index("worker") :]))
        assert {key: parsed[key] for key in expected} == expected, plan.name
    assert run(serve_args("--block-size", "0")) == 2
    with pytest.raises(SystemExit):  # the worker's choices, refused as the flags are parsed
        serve_args("--dtype", "float8")


def test_allowed_origins_reach_the_router():
    args = serve_args("--allowed-origins", "https://a.example", "https://b.example")
    spec = parse_cluster(merge_overrides(DEFAULT_CLUSTER, cluster_overrides(args)))
    router = plan_processes(spec, "cpu", num_gpus=0)[-1]
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    parsed = parser.parse_args(router.argv[router.argv.index("router") :])
    assert parsed.allowed_origins == ["https://a.example", "https://b.example"]


def test_served_model_names_reach_every_worker():
    """From the flag (several names) and from a cluster file (one name, or a list)."""
    from_flag = serve_args("--served-model-name", "a", "b", "--both", "1")
    one_pd = {"roles": {"pd": {"count": 1}}}
    specs = [
        (parse_cluster(merge_overrides(DEFAULT_CLUSTER, cluster_overrides(from_flag))), ["a", "b"]),
        (parse_cluster({"served_model_name": "a", **one_pd}), ["a"]),
        (parse_cluster({"served_model_name": ["a", "b"], **one_pd}), ["a", "b"]),
    ]
    worker_parser = argparse.ArgumentParser()
    add_worker_parser(worker_parser.add_subparsers())
    for spec, names in specs:
        for plan in plan_processes(spec, "cpu", num_gpus=0)[:-1]:
            command = plan.argv[plan.argv.index("worker") :]
            assert worker_parser.parse_args(command).served_model_name == names, plan.name
    unnamed = parse_cluster(DEFAULT_CLUSTER)
    assert all("--served-model-name" not in plan.argv for plan in plan_processes(unnamed, "cpu", 0))


@pytest.mark.parametrize("tool_call_parser", TOOL_CALL_PARSERS)  # each one the workers know
def test_auto_tool_choice_reaches_every_worker(tool_call_parser):
    args = serve_args(
        "--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser, "--both", "1"
    )
    spec = parse_cluster(merge_overrides(DEFAULT_CLUSTER, cluster_overrides(args)))
    workers = plan_processes(spec, "cpu", num_gpus=0, python="py")[:-1]
    assert [plan.name for plan in workers] == ["prefill-0", "decode-0", "both-0"]
    for plan in workers:
        flags = plan.argv[plan.argv.index("--enable-auto-tool-choice") :]
        assert flags[:3] == ("--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser)
    assert run(serve_args("--enable-auto-tool-choice")) == 2  # which parser is not said
    with pytest.raises(SystemExit):  # the worker's choices, refused as the flags are parsed
        serve_args("--enable-auto-tool-choice", "--tool-call-parser", "nope")
    # the parser alone does not turn "auto" on, as in the worker
    args = serve_args("--tool-call-parser", "hermes")
    spec = parse_cluster(merge_overrides(DEFAULT_CLUSTER, cluster_overrides(args)))
    assert all(
        "--tool-call-parser" not in plan.argv
        for plan in plan_processes(spec, "cpu", num_gpus=0, python="py")
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PD_ROLES + "prots: {router: 1}", "unknown key prots"),
        (
            PD_ROLES.replace("block_size: 16, kv", "blocksize: 16, kv", 1),
            "unknown key roles.prefill",
        ),
        (PD_ROLES + "device: tpu", "device"),
        ("roles: {prefill: {count: -1}}", "roles.prefill.count"),
        (
            PD_ROLES.replace("count: 1,", "count: 1, model: other,", 1),
            "every role must serve the same model",
        ),
        (
            PD_ROLES.replace("block_size: 16", "block_size: 32", 1),
            "roles.prefill.engine.block_size (32) differs from roles.decode.engine.block_size (16)",
        ),
        (
            PD_ROLES.replace("{block_size: 16,", "{block_size: 16, dtype: float16,", 1),
            "roles.prefill.engine.dtype (float16) differs",
        ),
        (
            PD_ROLES.replace("kv_transport: tcp}}\n", "kv_transport: cuda-ipc}}\n", 1),
            "roles.prefill.engine.kv_transport (cuda-ipc) differs",
        ),
        (
            "roles: {prefill: {count: 1}, decode: {count: 1}}",
            "decode workers have no way to receive KV",
        ),
        ("roles: {prefill: {count: 1}}", "no decode worker"),
        ("roles: {decode: {count: 2, engine: {kv_transport: tcp}}}", "no prefill worker"),
        ("roles: {both: {count: 0}}", "no workers"),
        (
            "device: cpu\nroles: {prefill: {count: 1}, decode: {count: 1, engine: "
            "{kv_transport: cuda-ipc}}}",
            "cuda-ipc KV transport needs GPUs",
        ),
        (
            "device: cpu\nroles: {pd: {count: 1, engine: {kv_transport: cuda-ipc}}}",
            "cuda-ipc KV transport needs GPUs",
        ),
        (PD_ROLES + "ports: {router: 8000, workers: 8001, kv: 8002}", "overlap"),
        (PD_ROLES + "ports: {router: 8101, workers: 8100}", "router port 8101"),
        ("- a\n- b", "the top level must be a mapping"),
    ],
)
def test_inconsistent_clusters_are_refused_with_one_sentence(text, expected):
    with pytest.raises(ClusterError) as refusal:
        parse_cluster(yaml.safe_load(text), "cluster.yaml")
    message = str(refusal.value)
    assert expected in message
    assert "\n" not in message and message.endswith(".")


def test_unreadable_files_are_refused(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("roles: [unclosed")
    with pytest.raises(ClusterError, match="is not valid YAML"):
        load_cluster_file(broken)
    with pytest.raises(ClusterError, match="Cannot read the cluster file"):
        load_cluster_file(tmp_path / "missing.yaml")


def test_planned_commands_follow_the_worker_cli_and_place_gpus():
    data = yaml.safe_load(PD_ROLES)
    spec = parse_cluster(merge_overrides(data, {"roles.both.count": 1, "ports.router": 7000}))
    assert "both" not in data["roles"]  # merging copies, it does not modify
    plans = plan_processes(spec, "cuda", num_gpus=2, python="py")
    assert [plan.name for plan in plans] == ["prefill-0", "decode-0", "both-0", "router"]
    assert plans[0].argv == (
        "py", "-m", "tandem.cli", "worker", "--model", "smollm2-135m-instruct",
        "--role", "prefill", "--host", "127.0.0.1", "--port", "7100", "--kv-port", "7200",
        "--device", "cuda:0", "--block-size", "16", "--kv-transport", "tcp",
    )  # fmt: skip
    devices = [plan.argv[plan.argv.index("--device") + 1] for plan in plans[:-1]]
    assert devices == ["cuda:0", "cuda:1", "cuda:0"]  # one GPU each, indices all workers share
    assert plans[2].argv[plans[2].argv.index("--port") + 1] == "7102"
    assert plans[-1].argv == (
        "py", "-m", "tandem.cli", "router", "--host", "127.0.0.1", "--port", "7000",
        "--prefill", "http://127.0.0.1:7100", "--decode", "http://127.0.0.1:7101",
        "--worker", "http://127.0.0.1:7102", "--busy-poll-s", "2.0",
    )  # fmt: skip
    cpu_router = plan_processes(spec, "cpu", num_gpus=0, python="py")[-1]
    assert "--busy-poll-s" not in cpu_router.argv  # a CPU cluster needs every core for its steps


@pytest.mark.parametrize(
    ("device", "num_gpus", "transport"), [("cuda", 2, "cuda-ipc"), ("cpu", 0, "tcp")]
)
def test_auto_kv_transport_is_gpu_direct_on_gpus(device, num_gpus, transport):
    spec = parse_cluster(DEFAULT_CLUSTER)
    for plan in plan_processes(spec, device, num_gpus=num_gpus, python="py")[:-1]:
        assert plan.argv[plan.argv.index("--kv-transport") + 1] == transport


def test_pd_servers_take_two_gpus_each_and_reach_the_router_as_colocated():
    spec = parse_cluster({"roles": {"both": {"count": 1}, "pd": {"count": 2}}})
    plans = plan_processes(spec, "cuda", num_gpus=4, python="py")
    assert [plan.name for plan in plans] == ["both-0", "pd-0", "pd-1", "router"]
    pd = plans[1].argv
    assert pd[pd.index("--role") + 1] == "pd" and pd[pd.index("--port") + 1] == "8101"
    devices = [
        (plan.argv[plan.argv.index("--device") + 1], plan.argv[plan.argv.index("--device") + 3])
        for plan in plans[1:3]
    ]
    assert plans[0].argv[plans[0].argv.index("--device") + 1] == "cuda:0"
    assert devices == [("cuda:1", "cuda:2"), ("cuda:3", "cuda:0")]  # round the four GPUs
    router = plans[-1].argv
    workers = [router[i + 1] for i, arg in enumerate(router) if arg == "--worker"]
    assert workers == [f"http://127.0.0.1:{port}" for port in (8100, 8101, 8102)]
    assert "--prefill" not in router and "--decode" not in router
    assert expected_router_counts(plans) == {"prefill": 0, "decode": 0, "both": 3}
    cpu = plan_processes(spec, "cpu", num_gpus=0, python="py")[1].argv
    assert cpu[cpu.index("--device") + 1] == "cpu" and "--decode-device" not in cpu


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (PD_ROLES + "cluster_token: hunter2", "cluster_token:"),
        (PD_ROLES + "router: {cluster_token: hunter2}", "router.cluster_token:"),
        (
            PD_ROLES + "router: {extra_args: [--cluster-token, hunter2]}",
            "router.extra_args (--cluster-token)",
        ),
        (
            PD_ROLES.replace("kv_transport: tcp}}\n", "extra_args: [--api-key=hunter2]}}\n", 1),
            "roles.prefill.engine.extra_args (--api-key=hunter2)",
        ),
    ],
)
def test_a_cluster_file_holding_a_secret_is_refused(tmp_path, text, where):
    """The cluster token (or the API key) does not belong in a file that gets committed, nor
    on a command line: the refusal says where it is and where the secret goes instead."""
    with pytest.raises(ClusterError) as refusal:
        parse_cluster(yaml.safe_load(text), "cluster.yaml")
    message = str(refusal.value)
    assert message.startswith(f"cluster.yaml: {where}") and "must not hold a secret" in message
    assert "--cluster-token or the environment variable TANDEM_CLUSTER_TOKEN" in message
    config = tmp_path / "cluster.yaml"
    config.write_text(text)
    assert run(serve_args("--config", str(config), "--device", "cpu")) == 2


def test_secrets_reach_the_children_in_their_environment_only():
    spec = parse_cluster(merge_overrides(DEFAULT_CLUSTER, {"roles.both.count": 1}))
    env = child_environment({"PATH": "/bin"}, "the-token", "the-key")
    assert env == {"PATH": "/bin", CLUSTER_TOKEN_ENV: "the-token", "TANDEM_API_KEY": "the-key"}
    assert CLUSTER_TOKEN_ENV == "TANDEM_CLUSTER_TOKEN"  # the name the worker and router read
    without_key = child_environment({"TANDEM_API_KEY": "inherited"}, "t", None)
    assert without_key == {"TANDEM_API_KEY": "inherited", CLUSTER_TOKEN_ENV: "t"}
    for plan in plan_processes(spec, "cpu", num_gpus=0):
        assert not {"the-token", "the-key", "--cluster-token", "--api-key"} & set(plan.argv)
