"""`tandem worker`: one engine behind the OpenAI-compatible HTTP server, in role prefill, decode
or both; or, in role pd, a prefill engine and a decode engine behind one server.

Flags are vLLM's where vLLM has them (`tandem worker MODEL` as `vllm serve MODEL`,
`--kv-transfer-config` included). `tandem.server.worker_flags` declares the ones every worker of
a cluster takes alike, which `tandem serve` passes on; the ones here place this one process (its
model, device, ports, role, KV endpoint, HTTP server, cluster).
"""

from __future__ import annotations

import argparse
import logging

from tandem import DEFAULT_MODEL
from tandem.access import (
    ALLOWED_ORIGINS_HELP,
    API_KEY_HELP,
    CLUSTER_TOKEN_ENV,
    api_key_from_env,
    cluster_token_from_env,
)
from tandem.engine.cli import (
    add_device_argument,
    add_model_arguments,
    engine_config_from_args,
    refuse_unknown_architecture,
)
from tandem.http_options import add_http_arguments, check_http_args
from tandem.kv.data import DATA_PLANES, installed
from tandem.server import kv_transfer_config
from tandem.server.worker_flags import KV_FLAG_DEFAULTS, add_worker_arguments

logger = logging.getLogger("tandem.worker")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("worker", help="serve one engine over the OpenAI API")
    add_model_arguments(parser, f"default: {DEFAULT_MODEL}")
    add_device_argument(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name in the API (default: the model); with several, answers carry "
        "the first and requests may use any",
    )
    parser.add_argument("--api-key", default=api_key_from_env(), help=API_KEY_HELP)
    parser.add_argument(
        "--allowed-origins", nargs="+", default=[], metavar="ORIGIN", help=ALLOWED_ORIGINS_HELP
    )
    parser.add_argument(
        "--role",
        default=KV_FLAG_DEFAULTS["role"],
        choices=["prefill", "decode", "both", "pd", "auto"],
        help="pd: a prefill engine and a decode engine behind this one server, the KV handed "
        "over between them (cuda-ipc on GPUs, else tcp); auto: prefill legs, decode legs and "
        "whole requests, as a router's planner assigns (its KV server and client both on)",
    )
    parser.add_argument(
        "--decode-device",
        default="auto",
        help="role pd: the decode engine's device (auto: the GPU after --device's when there "
        "is one, else the same device)",
    )
    add_http_arguments(parser.add_argument_group("HTTP server"))
    add_worker_arguments(parser)
    kv = parser.add_argument_group("KV transfer (PD)")
    kv.add_argument(
        "--kv-transport",
        default=None,
        choices=list(DATA_PLANES),
        help="tcp: any two hosts, no library; cuda-ipc: GPUs of one host; nixl, mooncake: "
        "across hosts over RDMA or TCP (pip install 'tandem[nixl]' / 'tandem[mooncake]')",
    )
    kv.add_argument(
        "--kv-host",
        default=None,
        help="address the KV port listens on and peers reach it at (default --host; needed "
        "when --host is 0.0.0.0)",
    )
    kv.add_argument("--kv-port", type=int, default=0, help="KV server port (0: any free port)")
    kv.add_argument(
        "--kv-transfer-config",
        type=kv_transfer_config.parse_kv_transfer_config,
        default=None,
        metavar="JSON",
        help="vLLM's, mapped onto the flags above: kv_role (kv_producer: --role prefill, "
        "kv_consumer: decode, kv_both: both), kv_connector (NixlConnector, P2pNcclConnector, "
        "MooncakeConnector, PyNcclConnector: --kv-transport tcp), kv_ip, kv_port, "
        "kv_load_failure_policy; vLLM's tuning keys are ignored",
    )
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--router", default=None, help="router URL to register with")
    cluster.add_argument(
        "--cluster-token",
        default=cluster_token_from_env(),
        help="the cluster's shared secret: presented to the router on registration, the only "
        "bearer allowed to set kv_transfer_params or release KV leases here, and what KV "
        "peers prove to each other. Needed for PD security: without it, anyone who reaches "
        "this worker or its KV port may use them (default: the environment variable "
        f"{CLUSTER_TOKEN_ENV}, which keeps it out of process lists)",
    )
    cluster.add_argument("--advertise-url", default=None, help="URL the router should use")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tandem.server.main import configure_logging, serve

    check_http_args(args, "worker")
    configure_logging()
    for note in kv_transfer_config.apply(args, KV_FLAG_DEFAULTS):
        logger.info("%s", note)
    if args.kv_transport and not installed(args.kv_transport):
        raise SystemExit(
            f"tandem worker: --kv-transport {args.kv_transport} needs its library: "
            f"pip install 'tandem[{args.kv_transport}]'"
        )
    config = engine_config_from_args(args, "worker")
    refuse_unknown_architecture(config, "worker")
    return serve(args, config)
