"""The flags vLLM users reach for, on `tandem worker` and `tandem serve`: parsed as vLLM's, and
doing what vLLM's do.

Parsing: the positional model, `--enable-prefix-caching`, `--kv-cache-dtype`, `--trust-remote-code`,
`--kv-transfer-config` (vLLM's keys onto tandem's flags), and `tandem serve` taking every flag
a worker takes alike (checked flag by flag against the worker's own parser); `--timeout-keep-alive`
on a router (the worker's is the same flag).

Behaviour, on real workers over one tiny random checkpoint without a tokenizer (SmolLM2's
vocabulary in two layers), given SmolLM2's tokenizer by `--tokenizer`, all started at once:

    flagged   --seed 7 --max-logprobs 3 --root-path /tandem --no-enable-prefix-caching
    tls       --seed 7 --ssl-keyfile K --ssl-certfile C --disable-log-requests
    producer  --seed 8 --kv-transfer-config {P2pNcclConnector, kv_producer, kv_port}
              --uvicorn-log-level warning
    consumer  --seed 8 --kv-transfer-config {P2pNcclConnector, kv_consumer}

Their weights are the checkpoint's whatever the seed, so greedy answers agree everywhere and
sampled ones differ by the seed alone.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pd_fixtures import run_direct, run_pd
from tandem import DEFAULT_MODEL
from tandem.cli import build_parser
from tandem.engine.cli import engine_config_from_args, refuse_unknown_architecture
from tandem.launcher.cli import cluster_data
from tandem.launcher.cluster import parse_cluster
from tandem.launcher.plan import plan_processes
from tandem.server import kv_transfer_config
from tandem.server.worker_flags import KV_FLAG_DEFAULTS
from tls_certificates import self_signed_certificate
from worker_fixtures import (
    STARTUP_TIMEOUT_S,
    WorkerProcess,
    free_port,
    start_tandem,
    start_worker,
)

# SmolLM2's vocabulary in a two-layer shape: an engine that loads in a moment
TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ROOT_PATH = "/tandem"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
# Greedy requests draw nothing from a worker's sampling generator: only the --seed test samples.
GREEDY = {"prompt": PROMPT, "temperature": 0.0}
# The worker flags `tandem serve` does not take: it sets them per worker (role, ports, KV
# endpoint, registration), or they belong to the router in a cluster (TLS).
PLANNED_PER_WORKER = {
    "--role",
    "--decode-device",
    "--kv-host",
    "--kv-port",
    "--kv-transfer-config",
    "--router",
    "--advertise-url",
    "--ssl-keyfile",
    "--ssl-certfile",
}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def option_strings(command: str) -> set[str]:
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    parser = subparsers.choices[command]
    return {flag for action in parser._actions for flag in action.option_strings}


# -- parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["worker", "generate"])
def test_the_model_comes_positionally_or_by_flag(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert engine_config_from_args(parse(command, "m.gguf", *extra), command).model == "m.gguf"
    by_flag = parse(command, "--model", "m.gguf", *extra)
    assert engine_config_from_args(by_flag, command).model == "m.gguf"
    assert engine_config_from_args(parse(command, *extra), command).model == DEFAULT_MODEL
    same_twice = parse(command, "m.gguf", "--model", "m.gguf", *extra)
    assert engine_config_from_args(same_twice, command).model == "m.gguf"
    with pytest.raises(SystemExit, match="the model is given twice"):
        engine_config_from_args(parse(command, "a.gguf", "--model", "b.gguf", *extra), command)


def test_serve_takes_the_model_positionally_and_gives_it_to_every_worker():
    spec = parse_cluster(cluster_data(parse("serve", "m.gguf", "--both", "1")))
    workers = plan_processes(spec, "cpu", num_gpus=0, python="py")[:-1]
    assert len(workers) == 3
    for plan in workers:
        assert plan.argv[plan.argv.index("--model") + 1] == "m.gguf", plan.name


def test_prefix_caching_is_on_unless_turned_off():
    assert engine_config_from_args(parse("worker"), "worker").enable_prefix_caching
    on = parse("worker", "--enable-prefix-caching")
    assert engine_config_from_args(on, "worker").enable_prefix_caching
    off = parse("worker", "--no-enable-prefix-caching")
    assert not engine_config_from_args(off, "worker").enable_prefix_caching


def test_an_fp8_kv_cache_is_refused_naming_auto(capsys):
    assert parse("worker", "--kv-cache-dtype", "auto").kv_cache_dtype == "auto"
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(SystemExit) as exit_:
            parse("worker", "--kv-cache-dtype", dtype)
        assert exit_.value.code == 2
        error = capsys.readouterr().err
        assert "no fp8 KV cache; use --kv-cache-dtype auto" in error, error
    with pytest.raises(SystemExit):
        parse("serve", "--kv-cache-dtype", "int8")
    error = capsys.readouterr().err
    assert "--kv-cache-dtype: invalid choice: 'int8'" in error and "auto" in error


def test_trust_remote_code_refuses_an_architecture_tandem_does_not_implement(tmp_path):
    unknown = tmp_path / "mamba"
    unknown.mkdir()
    (unknown / "config.json").write_text(
        json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    )
    config = engine_config_from_args(parse("worker", str(unknown), "--trust-remote-code"), "w")
    assert config.trust_remote_code
    with pytest.raises(SystemExit) as refusal:
        refuse_unknown_architecture(config, "worker")
    message = str(refusal.value)
    assert "'mamba' model (MambaForCausalLM)" in message
    assert "never runs a model's code" in message and "llama, mistral, qwen2, qwen3" in message
    refused = parse("worker", str(unknown), "--trust-remote-code")
    with pytest.raises(SystemExit, match="never runs a model's code"):  # before any engine
        refused.func(refused)
    known = tmp_path / "llama"
    known.mkdir()
    (known / "config.json").write_text(json.dumps(TINY_CONFIG))
    accepted = parse("worker", str(known), "--trust-remote-code")
    refuse_unknown_architecture(engine_config_from_args(accepted, "worker"), "worker")


def test_tokenizer_gives_a_config_in_dummy_weights_text(tmp_path, tokenizer_dir):
    """A shipped config (dummy weights in real shapes) has no tokenizer of its own: --tokenizer
    gives it one, a Hugging Face directory or a model whose tokenizer is taken."""
    from tandem.models.source import ModelNotFoundError, load_tokenizer, resolve_model

    config_only = resolve_model("qwen3-0.6b")
    assert load_tokenizer(config_only) is None
    for spec in (str(tokenizer_dir), DEFAULT_MODEL):
        tokenizer = load_tokenizer(config_only, spec)
        assert tokenizer.decode(tokenizer("Paris").input_ids) == "Paris", spec
    with pytest.raises(ModelNotFoundError, match="a config without a tokenizer"):
        load_tokenizer(config_only, "llama-3.1-8b")
    args = parse("worker", "qwen3-0.6b", "--load-format", "dummy", "--tokenizer", "tok")
    assert engine_config_from_args(args, "worker").tokenizer == "tok"


VLLM_KV_CONFIGS = [
    (
        {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
        {"role": "prefill", "kv_transport": "nixl"},
    ),
    (
        {"kv_connector": "P2pNcclConnector", "kv_role": "kv_consumer", "kv_port": 14579},
        {"role": "decode", "kv_transport": "tcp", "kv_port": 14579},
    ),
    (
        {"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_ip": "10.0.0.2"},
        {"role": "both", "kv_transport": "mooncake", "kv_host": "10.0.0.2"},
    ),
    (
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "fail",
            "kv_buffer_device": "cuda",
            "kv_connector_extra_config": {"backends": ["UCX"]},
            "engine_id": "e0",
        },
        {"role": "decode", "kv_transport": "nixl", "kv_load_failure_policy": "fail"},
    ),
]


@pytest.mark.parametrize(("vllm", "tandem_flags"), VLLM_KV_CONFIGS)
def test_vllm_kv_transfer_configs_become_tandem_flags(vllm, tandem_flags):
    args = parse("worker", "--kv-transfer-config", json.dumps(vllm))
    notes = kv_transfer_config.apply(args, KV_FLAG_DEFAULTS)
    expected = {**KV_FLAG_DEFAULTS, **tandem_flags}
    assert {dest: getattr(args, dest) for dest in KV_FLAG_DEFAULTS} == expected
    transport = tandem_flags["kv_transport"]
    assert any(f"{vllm['kv_connector']} maps to tandem's {transport} KV" in n for n in notes)
    ignored = [key for key in kv_transfer_config.IGNORED_KEYS if key in vllm]
    assert any(f"{', '.join(ignored)} ignored" in n for n in notes) == bool(ignored)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"kv_connector": "LMCacheConnectorV1"}', "keeps KV outside the workers"),
        ('{"kv_connector": "SharedStorageConnector"}', "keeps KV outside the workers"),
        ('{"kv_connector": "MyConnector"}', "'MyConnector' is unknown; tandem takes"),
        ('{"kv_role": "kv_sender"}', "kv_role must be one of kv_producer"),
        ('{"kv_port": "14579"}', "kv_port must be a port number"),
        ('{"kv_port": 70000}', "kv_port must be a port number"),
        ('{"kv_load_failure_policy": "retry"}', "must be recompute or fail"),
        ('{"kv_conector": "NixlConnector"}', "unknown key kv_conector"),
        ("kv_producer", "not valid JSON"),
        ('["kv_producer"]', "must be a JSON object"),
    ],
)
def test_kv_transfer_configs_tandem_cannot_follow_are_refused(capsys, text, error):
    with pytest.raises(SystemExit) as exit_:
        parse("worker", "--kv-transfer-config", text)
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err


def test_a_flag_beside_the_kv_transfer_config_must_agree_with_it():
    producer = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
    agreeing = parse("worker", "--role", "prefill", "--kv-transfer-config", producer)
    kv_transfer_config.apply(agreeing, KV_FLAG_DEFAULTS)
    assert agreeing.role == "prefill"
    clashing = parse("worker", "--role", "decode", "--kv-transfer-config", producer)
    with pytest.raises(SystemExit, match="--role decode disagrees with --kv-transfer-config"):
        kv_transfer_config.apply(clashing, KV_FLAG_DEFAULTS)
    # the transport a user names wins over the connector's (GPU to GPU on one host)
    gpu_direct = parse("worker", "--kv-transport", "cuda-ipc", "--kv-transfer-config", producer)
    kv_transfer_config.apply(gpu_direct, KV_FLAG_DEFAULTS)
    assert (gpu_direct.role, gpu_direct.kv_transport) == ("prefill", "cuda-ipc")


def test_serve_takes_every_flag_a_worker_takes_except_those_it_plans_per_worker():
    """A flag added to the worker's shared ones reaches `tandem serve` by itself; the only
    worker flags serve lacks are the ones it sets for each process (ports, role, KV endpoint,
    registration) or that belong to the router in a cluster (TLS)."""
    worker, serve = option_strings("worker"), option_strings("serve")
    assert worker - serve == PLANNED_PER_WORKER


def a_value_for(action: argparse.Action) -> list[str]:
    """Arguments setting `action` to a value other than the worker's default."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[1]]  # --no-...: the defaults are on
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, list(action.choices)[-1]]
    if action.type is float:
        return [flag, "0.5"]
    if action.type is None:
        return [flag, "some-value"]
    return [flag, "3"]  # the integers, positive and depth-limited ones included


def test_every_shared_worker_flag_given_to_serve_reaches_every_worker_as_given():
    """Each flag set away from its default on `tandem serve` parses, on each planned worker's
    command line, to what it parsed to on serve's: the cluster file's keys (dtype, block size,
    parsers...) and the others (seed, tokenizer, prefix caching, limits, ...) alike."""
    actions = parse("serve").worker_flags
    argv = [arg for action in actions for arg in a_value_for(action)]
    serve_args = parse("serve", "--both", "1", *argv)
    spec = parse_cluster(cluster_data(serve_args))
    workers = plan_processes(spec, "cpu", num_gpus=0, python="py")[:-1]
    assert [plan.name for plan in workers] == ["prefill-0", "decode-0", "both-0"]
    for plan in workers:
        parsed = parse(*plan.argv[plan.argv.index("worker") :])
        for action in actions:
            expected = getattr(serve_args, action.dest)
            assert getattr(parsed, action.dest) == expected, (plan.name, action.dest)
    assert engine_config_from_args(parsed, "worker").seed == 3
    nothing_given = parse_cluster(cluster_data(parse("serve", "--both", "1")))
    planned = plan_processes(nothing_given, "cpu", num_gpus=0, python="py")[0].argv
    assert "--seed" not in planned and "--no-enable-prefix-caching" not in planned


def test_serve_gives_request_logs_and_the_root_path_to_the_router():
    given = ("--root-path", "/api", "--disable-log-requests", "--timeout-keep-alive", "30")
    spec = parse_cluster(cluster_data(parse("serve", *given)))
    *workers, router = plan_processes(spec, "cpu", num_gpus=0, python="py")
    routed = parse(*router.argv[router.argv.index("router") :])
    assert (routed.root_path, routed.disable_log_requests) == ("/api", True)
    assert routed.timeout_keep_alive == 30
    for plan in workers:
        worker = parse(*plan.argv[plan.argv.index("worker") :])
        assert worker.disable_log_requests and worker.timeout_keep_alive == 30
        assert "--root-path" not in plan.argv  # workers are reached on loopback, unprefixed
    nothing_given = parse_cluster(cluster_data(parse("serve")))
    defaults = plan_processes(nothing_given, "cpu", num_gpus=0, python="py")
    assert all("--timeout-keep-alive" not in plan.argv for plan in defaults)
    assert parse("worker").timeout_keep_alive == parse("router").timeout_keep_alive == 75


def kept_open_after(port: int, idle_s: float) -> bool:
    """Whether a connection that sat idle for idle_s still takes a request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/version")
        connection.getresponse().read()
        time.sleep(idle_s)
        connection.request("GET", "/version")
        return connection.getresponse().status == 200
    except (http.client.RemoteDisconnected, ConnectionError):
        return False
    finally:
        connection.close()


@pytest.mark.slow  # 11 s of idle connections
def test_idle_connections_outlive_client_pools_and_close_after_the_flags_time(tmp_path):
    """A router keeps an idle connection past the 5 s after which httpx (the openai client)
    drops it from its pool, so it never closes one under a request sent on it; with
    `--timeout-keep-alive 1` it closes it after a second (the worker's flag is the same one,
    tandem.http_options)."""
    workers = ("--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2")
    routers = {
        keep_alive: start_tandem(tmp_path, "router", *workers, *keep_alive)
        for keep_alive in [(), ("--timeout-keep-alive", "1")]
    }
    try:
        for router in routers.values():
            wait_healthy(router, router.url, path="/version")  # /health: 503 with no worker
        short = routers[("--timeout-keep-alive", "1")].port
        assert kept_open_after(short, 0.1) and not kept_open_after(short, 2.5)
        assert kept_open_after(routers[()].port, 6.0)
    finally:
        for router in routers.values():
            router.stop()


def test_uvicorn_log_levels_are_uvicorns(capsys):
    assert parse("worker").uvicorn_log_level == "info"  # vLLM's: one line per request
    assert parse("worker", "--uvicorn-log-level", "warning").uvicorn_log_level == "warning"
    with pytest.raises(SystemExit):
        parse("worker", "--uvicorn-log-level", "loud")
    error = capsys.readouterr().err.replace("'", "")
    assert "choose from critical, error, warning, info, debug, trace" in error


# -- behaviour --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer as a Hugging Face directory (what --tokenizer usually names)."""
    from tandem.models.source import load_tokenizer, resolve_model

    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_tokenizer(resolve_model(DEFAULT_MODEL)).save_pretrained(directory)
    return directory


def wait_healthy(worker: WorkerProcess, url: str, path="/health", **client_options) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(**client_options) as client:
        while True:
            assert worker.process.poll() is None, worker.log_tail()
            try:
                if client.get(f"{url}{path}", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.25)


def tiny_checkpoint(directory: Path) -> Path:
    """TINY_CONFIG in random weights, saved by transformers (config.json and safetensors, no
    tokenizer files)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_CONFIG), dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tokenizer_dir) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("vllm-flags")
    key, cert = self_signed_certificate(root)
    common = ("--tokenizer", str(tokenizer_dir), "--num-kv-blocks", "64")
    kv_port = free_port()
    producer = {"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer", "kv_port": kv_port}
    consumer = {"kv_connector": "P2pNcclConnector", "kv_role": "kv_consumer"}
    specs = {
        "flagged": ("--seed", "7", "--max-logprobs", "3", "--root-path", ROOT_PATH)
        + ("--no-enable-prefix-caching",),
        "tls": ("--seed", "7", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
        + ("--disable-log-requests",),
        "producer": ("--seed", "8", "--kv-transfer-config", json.dumps(producer))
        + ("--uvicorn-log-level", "warning"),
        "consumer": ("--seed", "8", "--kv-transfer-config", json.dumps(consumer)),
    }
    model = str(tiny_checkpoint(root / "tiny"))
    started = {}
    try:
        for name, flags in specs.items():
            started[name] = start_worker(root, *common, *flags, model=model)
        urls = {name: worker.url for name, worker in started.items()}
        urls["tls"] = urls["tls"].replace("http://", "https://")
        trusted = ssl.create_default_context(cafile=str(cert))
        for name, worker in started.items():
            wait_healthy(worker, urls[name], verify=trusted if name == "tls" else True)
        yield {"processes": started, "urls": urls, "tls": {"verify": trusted}, "kv_port": kv_port}
    finally:
        for worker in started.values():
            worker.stop()


def complete(url: str, body: dict, **client_options) -> httpx.Response:
    with httpx.Client(**client_options) as client:
        return client.post(f"{url}/v1/completions", json=body, timeout=120)


def test_seed_makes_unseeded_sampled_requests_reproducible(workers):
    """Workers started with the same --seed answer the same unseeded sampled requests alike,
    and one started with another seed otherwise (the weights are the same: the checkpoint's);
    each sample differs from the next (one generator, not one seed per request)."""
    urls = workers["urls"]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "return_token_ids": True}
    answers = {}
    for name, options in (("flagged", {}), ("tls", workers["tls"]), ("producer", {})):
        answers[name] = [
            complete(urls[name], body, **options).json()["choices"][0]["token_ids"]
            for _ in range(2)
        ]
    assert answers["flagged"] == answers["tls"]
    assert answers["producer"][0] != answers["flagged"][0]
    first, second = answers["flagged"]
    assert first != second


def test_tokenizer_gives_text_to_a_model_without_one(workers, tokenizer_dir):
    """The checkpoint without tokenizer files answers text prompts in text, streamed and whole;
    the text is the tokenizer's reading of the token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    url = workers["urls"]["flagged"]
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.0, "return_token_ids": True}
    answer = complete(url, body).json()
    assert answer["usage"]["prompt_tokens"] == len(tokenizer(PROMPT).input_ids)
    whole = answer["choices"][0]
    assert whole["text"] == tokenizer.decode(whole["token_ids"], skip_special_tokens=True)
    streamed, token_ids = "", []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                streamed += choice["text"]
                token_ids += choice.get("token_ids") or []
    assert token_ids == whole["token_ids"] and streamed == whole["text"]
    assert streamed.strip()


def test_max_logprobs_refuses_more_with_a_400(workers):
    flagged, tls = workers["urls"]["flagged"], workers["urls"]["tls"]
    tls_options = workers["tls"]
    allowed = complete(flagged, {**GREEDY, "max_tokens": 2, "logprobs": 3}).json()
    assert [len(top) for top in allowed["choices"][0]["logprobs"]["top_logprobs"]] == [3, 3]
    refusals = [
        (f"{flagged}/v1/completions", {"prompt": PROMPT, "logprobs": 4}, "logprobs", {}),
        (
            f"{flagged}/v1/completions",
            {"prompt": PROMPT, "prompt_logprobs": 4},
            "prompt_logprobs",
            {},
        ),
        (
            f"{flagged}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4},
            "top_logprobs",
            {},
        ),
        (
            f"{tls}/v1/completions",
            {"prompt": PROMPT, "logprobs": 21},
            "logprobs",
            tls_options,
        ),
    ]
    for url, body, param, options in refusals:
        with httpx.Client(**options) as client:
            response = client.post(url, json={**body, "max_tokens": 2}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "--max-logprobs" in error["message"], error
    at_vllms_default = complete(tls, {**GREEDY, "max_tokens": 1, "logprobs": 20}, **tls_options)
    assert len(at_vllms_default.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 20


def test_root_path_serves_under_the_prefix_and_behind_a_proxy_that_strips_it(workers):
    url = workers["urls"]["flagged"]
    for path in (f"{ROOT_PATH}/v1/models", "/v1/models", f"{ROOT_PATH}/health", "/health"):
        assert httpx.get(url + path, timeout=10).status_code == 200, path
    answer = complete(url + ROOT_PATH, {**GREEDY, "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{url}/other/v1/models", timeout=10).status_code == 404
    no_prefix = httpx.get(workers["urls"]["tls"] + f"{ROOT_PATH}/v1/models", **workers["tls"])
    assert no_prefix.status_code == 404  # a worker without --root-path has no such path


def test_ssl_serves_https_with_the_certificate_and_nothing_in_clear(workers):
    url = workers["urls"]["tls"]
    response = httpx.get(f"{url}/v1/models", **workers["tls"], timeout=10)
    assert response.status_code == 200 and response.url.scheme == "https"
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://") + "/v1/models", timeout=10)


def test_prefix_caching_can_be_turned_off(workers):
    """The same two-block prompt twice: the second finds its blocks cached on a worker with the
    default, and nothing cached on one started with --no-enable-prefix-caching."""
    body = {"prompt": list(range(1000, 1040)), "max_tokens": 1, "temperature": 0.0}
    cached = {}
    for name, options in (("flagged", {}), ("tls", workers["tls"])):
        for _ in range(2):
            usage = complete(workers["urls"][name], body, **options).json()["usage"]
        cached[name] = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == {"flagged": 0, "tls": 32}


def test_requests_are_logged_one_line_each_unless_disabled(workers):
    processes = workers["processes"]
    complete(workers["urls"]["flagged"] + ROOT_PATH, {**GREEDY, "max_tokens": 1})
    complete(workers["urls"]["tls"], {**GREEDY, "max_tokens": 1}, **workers["tls"])
    line = f'"POST {ROOT_PATH}/v1/completions HTTP/1.1" 200'
    deadline = time.monotonic() + 10
    while line not in processes["flagged"].log_path.read_text():
        assert time.monotonic() < deadline, processes["flagged"].log_tail()
        time.sleep(0.1)
    assert "/v1/completions HTTP/1.1" not in processes["tls"].log_path.read_text()
    # probes and scrapes log nothing (a router checks each worker's health once a second)
    httpx.get(workers["urls"]["flagged"] + "/metrics", timeout=10).raise_for_status()
    assert "GET /health" not in processes["flagged"].log_path.read_text()
    assert "GET /metrics" not in processes["flagged"].log_path.read_text()
    # --uvicorn-log-level warning: not even the server's start-up lines
    assert "Application startup complete" in processes["flagged"].log_path.read_text()
    assert "Application startup complete" not in processes["producer"].log_path.read_text()


def test_a_vllm_pd_launch_script_runs_with_tandem_worker(workers):
    """Workers started with vLLM's --kv-transfer-config take their roles and KV endpoint from
    it, and answer a PD request (the two legs of vLLM's protocol) as a colocated worker does."""
    urls, processes = workers["urls"], workers["processes"]
    producer = httpx.get(f"{urls['producer']}/health", timeout=10).json()
    assert producer["role"] == "prefill"
    assert producer["kv"]["transport"] == "tcp" and producer["kv"]["port"] == workers["kv_port"]
    assert httpx.get(f"{urls['consumer']}/health", timeout=10).json()["role"] == "decode"
    log = processes["producer"].log_path.read_text()
    assert "P2pNcclConnector maps to tandem's tcp KV transport" in log
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    with httpx.Client() as client:
        pd = run_pd(client, urls["producer"], urls["consumer"], "/v1/completions", body)
        direct = run_direct(client, urls["flagged"], "/v1/completions", body)
    assert pd == direct and len(pd.token_ids) == 8
