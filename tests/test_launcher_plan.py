"""Tensor parallelism in `tandem serve`: per-role sizes from the cluster file and the flags, GPU
placement (N GPUs per worker, contiguous, none shared), the refusal of a cluster that needs more
GPUs than the host has, the KV transport such a cluster can use, and the refusal of sizes the
model cannot be split over (the worker's own rule), each in one sentence."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from tandem.engine.cli import engine_config_from_args
from tandem.executor.rank import rank_device
from tandem.launcher.cli import add_parser, cluster_data, run
from tandem.launcher.cluster import ClusterError, parse_cluster
from tandem.launcher.plan import check_model_splits, plan_processes
from tandem.server.cli import add_parser as add_worker_parser

MIXED = """
roles:
  prefill: {count: 1, engine: {tensor_parallel_size: 2, kv_transport: auto}}
  decode: {count: 2, engine: {kv_transport: auto}}
"""


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def worker_args(argv: tuple[str, ...]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_parser(parser.add_subparsers())
    return parser.parse_args(list(argv[argv.index("worker") :]))


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def gpus_of(argv: tuple[str, ...]) -> list[int]:
    """The GPUs the worker's ranks run on, as the worker itself reads its command line."""
    config = engine_config_from_args(worker_args(argv), "worker")
    return [rank_device(config, rank).index for rank in range(config.tensor_parallel_size)]


def test_a_tensor_parallel_prefill_and_two_decodes_take_four_gpus_without_overlap():
    plans = plan_processes(parse_cluster(yaml.safe_load(MIXED)), "cuda", num_gpus=4, python="py")
    workers = plans[:-1]
    assert [plan.name for plan in workers] == ["prefill-0", "decode-0", "decode-1"]
    assert [gpus_of(plan.argv) for plan in workers] == [[0, 1], [2], [3]]
    assert [flag(plan.argv, "--device") for plan in workers] == ["cuda:0", "cuda:2", "cuda:3"]
    assert flag(workers[0].argv, "--tensor-parallel-size") == "2"
    assert "--tensor-parallel-size" not in workers[1].argv  # the worker's default, 1
    for plan in workers:  # auto is cuda-ipc on GPUs, tensor-parallel workers or not
        assert flag(plan.argv, "--kv-transport") == "cuda-ipc", plan.name
    on_cpus = plan_processes(parse_cluster(yaml.safe_load(MIXED)), "cpu", num_gpus=0, python="py")
    assert {flag(plan.argv, "--kv-transport") for plan in on_cpus[:-1]} == {"tcp"}


def test_pd_servers_take_both_engines_ranks():
    spec = parse_cluster(
        {"roles": {"pd": {"count": 2, "engine": {"tensor_parallel_size": 2}}, "both": {"count": 1}}}
    )
    plans = plan_processes(spec, "cuda", num_gpus=9, python="py")
    both, first, second = plans[:3]
    assert gpus_of(both.argv) == [0]
    devices = [(flag(p.argv, "--device"), flag(p.argv, "--decode-device")) for p in (first, second)]
    assert devices == [("cuda:1", "cuda:3"), ("cuda:5", "cuda:7")]
    assert "--kv-transport" not in first.argv  # the pd server's default (cuda-ipc) moves it
    assert "--kv-transport" not in both.argv


@pytest.mark.parametrize(
    ("text", "num_gpus", "needed"),
    [
        (MIXED, 3, 4),
        ("roles: {pd: {count: 1, engine: {tensor_parallel_size: 2}}}", 3, 4),
        (MIXED.replace("count: 2,", "count: 3,"), 4, 5),  # one-GPU workers beside TP ones
    ],
)
def test_a_cluster_needing_more_gpus_than_the_host_has_is_refused(text, num_gpus, needed):
    spec = parse_cluster(yaml.safe_load(text))
    with pytest.raises(ClusterError) as refusal:
        plan_processes(spec, "cuda", num_gpus=num_gpus)
    message = str(refusal.value)
    assert f"needs {needed} GPUs" in message and f"this host has {num_gpus}" in message
    assert "\n" not in message and message.endswith(".")
    assert len(plan_processes(spec, "cpu", num_gpus=0)) == spec.num_workers + 1  # ranks on CPU


def test_the_sizes_come_per_role_from_the_file_and_the_flags():
    def sizes(*argv: str) -> list[int]:
        """Each planned worker's size, as its own parser reads its command line."""
        spec = parse_cluster(cluster_data(serve_args("--device", "cpu", "--both", "1", *argv)))
        return [
            worker_args(plan.argv).tensor_parallel_size
            for plan in plan_processes(spec, "cpu", num_gpus=0)[:-1]
        ]

    assert sizes() == [1, 1, 1]  # prefill, decode, both
    assert sizes("-tp", "2") == [2, 2, 2]
    assert sizes("--tensor-parallel-size", "4", "--decode-tp", "1") == [4, 1, 4]
    assert sizes("--prefill-tp", "2") == [2, 1, 1]
    with pytest.raises(SystemExit):
        serve_args("--decode-tp", "0")
    spec = parse_cluster(yaml.safe_load(MIXED))
    assert spec.engine_of("prefill").tensor_parallel_size == 2
    assert spec.engine_of("decode").tensor_parallel_size is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            MIXED.replace("tensor_parallel_size: 2", "tensor_parallel_size: 0"),
            "roles.prefill.engine.tensor_parallel_size",
        ),
        (
            "roles: {both: {count: 1, engine: {extra_args: [-tp, '2']}}}",
            "roles.both.engine.extra_args holds -tp; give the size as "
            "roles.both.engine.tensor_parallel_size",
        ),
    ],
)
def test_tensor_parallel_clusters_that_cannot_work_are_refused(text, expected):
    with pytest.raises(ClusterError) as refusal:
        parse_cluster(yaml.safe_load(text), "cluster.yaml")
    message = str(refusal.value)
    assert expected in message
    assert "\n" not in message and message.endswith(".")


@pytest.mark.parametrize(
    "text",
    [
        MIXED.replace("kv_transport: auto", "kv_transport: cuda-ipc"),
        MIXED.replace("kv_transport: auto", "kv_transport: nixl"),
        MIXED.replace("kv_transport: auto", "kv_transport: mooncake"),
        "roles: {pd: {count: 1, engine: {tensor_parallel_size: 2, kv_transport: cuda-ipc}}}",
    ],
)
def test_tensor_parallel_workers_take_every_kv_transport(text):
    parse_cluster(yaml.safe_load(text), "cluster.yaml")  # each rank reads its own KV heads


def test_one_gpu_workers_with_kv_over_cuda_ipc_stay_as_they_were():
    text = "roles: {prefill: {count: 1}, decode: {count: 1, engine: {kv_transport: cuda-ipc}}}"
    plans = plan_processes(parse_cluster(yaml.safe_load(text)), "cuda", num_gpus=1)
    assert [flag(plan.argv, "--device") for plan in plans[:-1]] == ["cuda:0", "cuda:0"]
    assert {flag(plan.argv, "--kv-transport") for plan in plans[:-1]} == {"cuda-ipc"}


def checkpoint(tmp_path, heads: int, kv_heads: int) -> str:
    """A directory with only a Llama config.json of `heads` attention and `kv_heads` KV heads."""
    directory = tmp_path / f"h{heads}-kv{kv_heads}"
    directory.mkdir()
    config = dict(
        model_type="llama", vocab_size=256, hidden_size=16 * heads, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
    )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def pd_cluster(model: str, prefill_tp: int, decode_tp: int):
    return parse_cluster(
        {
            "model": model,
            "device": "cpu",
            "roles": {
                "prefill": {"count": 1, "engine": {"tensor_parallel_size": prefill_tp}},
                "decode": {
                    "count": 1,
                    "engine": {"tensor_parallel_size": decode_tp, "kv_transport": "tcp"},
                },
            },
        }
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "prefill_tp", "decode_tp"),
    [(4, 2, 4, 1), (4, 2, 2, 4), (8, 8, 4, 2), (6, 2, 2, 1), (6, 6, 1, 6)],
)
def test_sizes_the_model_splits_into_pair(tmp_path, heads, kv_heads, prefill_tp, decode_tp):
    """KV heads fewer than ranks are replicated (2 KV heads at TP 4), as the worker does."""
    check_model_splits(pd_cluster(checkpoint(tmp_path, heads, kv_heads), prefill_tp, decode_tp))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "prefill_tp", "decode_tp", "expected"),
    [
        (
            6, 2, 4, 1,
            "roles.prefill: --tensor-parallel-size 4 does not divide the model's 6 attention "
            "heads: use a size that does.",
        ),
        (
            6, 3, 1, 2,
            "roles.decode: --tensor-parallel-size 2 neither divides the model's 3 KV heads nor "
            "is a multiple of them: use a size that does either.",
        ),
    ],
)  # fmt: skip
def test_sizes_the_model_cannot_split_into_are_refused_at_start(
    tmp_path, capsys, heads, kv_heads, prefill_tp, decode_tp, expected
):
    model = checkpoint(tmp_path, heads, kv_heads)
    with pytest.raises(ClusterError) as refusal:
        check_model_splits(pd_cluster(model, prefill_tp, decode_tp))
    assert str(refusal.value) == expected
    argv = ("--model", model, "--device", "cpu")
    argv += ("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp))
    assert run(serve_args(*argv)) == 2  # before anything starts
    assert capsys.readouterr().err == f"tandem serve: {expected}\n"


def test_a_missing_model_under_tensor_parallelism_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ClusterError, match=r"^roles.prefill: model .* not found: give"):
        check_model_splits(pd_cluster(str(tmp_path / "nothing"), 2, 1))
