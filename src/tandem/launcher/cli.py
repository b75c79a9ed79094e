"""`tandem serve`: a router and its workers on this host, from flags or a cluster YAML file.

Flags given on the command line override the file; without a file, the cluster is one prefill
and one decode worker on the default model; the KV transport is GPU-direct (cuda-ipc) when the
workers run on GPUs, TCP otherwise. Secrets come from flags or the environment, never from the
file: the cluster token (`--cluster-token`, else $TANDEM_CLUSTER_TOKEN, else a fresh random one)
and the API key reach every child in its environment. Imports only argparse and the standard
library at import time.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import Any

# Engine flags `tandem serve` gives every worker: flag -> (type, help); each is an EngineSettings
# field of every role (a cluster file can set them per role instead).
ENGINE_FLAGS: dict[str, tuple[type, str]] = {
    "--dtype": (str, "auto, float32, bfloat16 or float16"),
    "--max-model-len": (int, "the context length (default: the model's)"),
    "--max-num-seqs": (int, "sequences in one batch"),
    "--max-num-batched-tokens": (int, "tokens in one step"),
    "--gpu-memory-utilization": (float, "the fraction of GPU memory a worker may use"),
    "--block-size": (int, "tokens per KV block"),
    "--num-kv-blocks": (int, "KV blocks per worker (default: what the memory allows)"),
    "--scheduling-policy": (str, "fcfs or priority (requests' priority, lower first)"),
}

DEFAULT_CLUSTER: dict[str, Any] = {
    "roles": {
        "prefill": {"count": 1, "engine": {"kv_transport": "auto"}},
        "decode": {"count": 1, "engine": {"kv_transport": "auto"}},
    }
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start a router and its workers on this host",
        description="Start a router and prefill/decode workers, wait until all are healthy, "
        "restart any that exits, and stop all of them on Ctrl-C or SIGTERM.",
    )
    parser.add_argument("--config", metavar="CLUSTER_YAML", help="cluster description file")
    parser.add_argument("--model", help="model to serve (default: smollm2-135m-instruct)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model's name(s) in the API, given to every worker (default: --model)",
    )
    parser.add_argument("--prefill", type=int, metavar="N", help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, metavar="N", help="decode workers (default 1)")
    parser.add_argument("--both", type=int, metavar="N", help="colocated workers (default 0)")
    parser.add_argument(
        "--pd",
        type=int,
        metavar="N",
        help="servers that each run a prefill and a decode engine (two GPUs), seen by the router "
        "as colocated workers (default 0; with --prefill 0 --decode 0 for them alone)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default: auto")
    parser.add_argument(
        "--kv-transport",
        choices=("auto", "tcp", "cuda-ipc"),
        help="KV transport of prefill and decode (default auto: cuda-ipc on GPUs, else tcp)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='workers answer tool_choice "auto" with calls found by --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="the model's tool call format: hermes, llama3_json, mistral or pythonic "
        "(see tandem worker --help)",
    )
    parser.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="workers split reasoning off chat answers: deepseek_r1 or qwen3 "
        "(see tandem worker --help)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="TEMPLATE",
        help="workers render chat messages with this Jinja template (or the file holding one) "
        "instead of the model's",
    )
    parser.add_argument(
        "--api-key",
        help="the router and every worker require 'Authorization: Bearer KEY' on all but "
        "/health, /version and /metrics (given to them in the environment variable "
        "TANDEM_API_KEY, which they also read when this flag is left out)",
    )
    parser.add_argument(
        "--cluster-token",
        default=None,
        help="the cluster's shared secret, which workers and the router prove to each other "
        "(default: the environment variable TANDEM_CLUSTER_TOKEN, else a fresh random one); "
        "given to every process in its environment, never on a command line",
    )
    parser.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help="the router answers browsers' cross-origin (CORS) requests from these origins, or "
        "* for any (default: none)",
    )
    engine = parser.add_argument_group("engine (every worker; worker defaults when left out)")
    for flag, (kind, text) in ENGINE_FLAGS.items():
        engine.add_argument(flag, type=kind, help=text)
    parser.add_argument("--host", help="the router's bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="the router's port (default 8000)")
    parser.add_argument(
        "--worker-port-base", type=int, metavar="PORT", help="first worker port (default port+100)"
    )
    parser.add_argument(
        "--kv-port-base", type=int, metavar="PORT", help="first KV port (default port+200)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds a process gets to be healthy after each start",
    )
    parser.add_argument(
        "--max-start-failures",
        type=_positive_int,
        default=3,
        metavar="N",
        help="a process that exits (or is not healthy within --startup-timeout) before it was "
        "ever healthy since its start, N times in a row, stops the cluster; any other exit is "
        "restarted after a backoff of 1 s doubling to 30 s (default 3)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        help="seconds a process gets to exit after SIGTERM before SIGKILL",
    )
    parser.set_defaults(func=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def cluster_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted keys that the flags given on the command line set."""
    from tandem.launcher.cluster import WORKER_ROLES

    parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    flags = {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "device": args.device,
        "roles.prefill.count": args.prefill,
        "roles.decode.count": args.decode,
        "roles.both.count": args.both,
        "roles.pd.count": args.pd,
        "roles.prefill.engine.kv_transport": args.kv_transport,
        "roles.decode.engine.kv_transport": args.kv_transport,
        "roles.pd.engine.kv_transport": args.kv_transport,
        **{f"roles.{role}.engine.tool_call_parser": parser for role in WORKER_ROLES},
        **{f"roles.{role}.engine.reasoning_parser": args.reasoning_parser for role in WORKER_ROLES},
        **{f"roles.{role}.engine.chat_template": args.chat_template for role in WORKER_ROLES},
        **{
            f"roles.{role}.engine.{field}": getattr(args, field)
            for field in (flag[2:].replace("-", "_") for flag in ENGINE_FLAGS)
            for role in WORKER_ROLES
        },
        "router.host": args.host,
        "router.allowed_origins": args.allowed_origins,
        "ports.router": args.port,
        "ports.workers": args.worker_port_base,
        "ports.kv": args.kv_port_base,
    }
    return {key: value for key, value in flags.items() if value is not None}


def run(args: argparse.Namespace) -> int:
    from tandem.access import cluster_token_from_env
    from tandem.launcher.cluster import (
        ClusterError,
        load_cluster_file,
        merge_overrides,
        parse_cluster,
    )
    from tandem.launcher.plan import child_environment, plan_processes, resolve_device
    from tandem.launcher.supervisor import Supervisor

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("tandem serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    try:
        data = load_cluster_file(args.config) if args.config else DEFAULT_CLUSTER
        spec = parse_cluster(merge_overrides(data, cluster_overrides(args)), args.config)
        device, num_gpus = resolve_device(spec.device)
    except (ClusterError, RuntimeError) as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    cluster_token = args.cluster_token or cluster_token_from_env()
    roles = spec.roles
    print(
        f"tandem serve: starting {spec.model} on {device}: {roles.prefill.count} prefill, "
        f"{roles.decode.count} decode, {roles.both.count} both, {roles.pd.count} pd",
        flush=True,
    )
    if cluster_token is None:
        cluster_token = secrets.token_urlsafe(32)
        print(
            "tandem serve: the cluster token is a fresh random one; to register workers of your "
            "own with this router, give tandem serve one (--cluster-token or "
            "TANDEM_CLUSTER_TOKEN)",
            flush=True,
        )
    env = child_environment(os.environ, cluster_token, args.api_key)
    plans = plan_processes(spec, device, num_gpus)
    supervisor = Supervisor(
        plans,
        startup_timeout_s=args.startup_timeout,
        stop_timeout_s=args.stop_timeout,
        max_start_failures=args.max_start_failures,
        env=env,
    )
    return supervisor.run()
