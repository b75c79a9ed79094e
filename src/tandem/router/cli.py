"""`tandem router`: the OpenAI-compatible front door of a PD cluster.

Imports only argparse at import time; the server's modules load when the command runs.
"""

from __future__ import annotations

import argparse

from tandem.access import (
    ALLOWED_ORIGINS_HELP,
    API_KEY_HELP,
    CLUSTER_TOKEN_ENV,
    api_key_from_env,
    cluster_token_from_env,
)
from tandem.http_options import add_http_arguments, check_http_args
from tandem.limits import add_body_limit_arguments, body_limits_from_args
from tandem.router.config import (
    DECODE_POLICIES,
    DISAGGREGATION_MODES,
    PREFILL_POLICIES,
    RouterConfig,
)

DEFAULTS = RouterConfig()
# what the router's responses get to finish once it is told to stop: a worker's grace
GRACEFUL_SHUTDOWN_S = 10
# what ends an answer that the graceful shutdown's deadline cuts (`tandem.shutdown_cut`)
SHUTTING_DOWN = "the router is shutting down and cut this request short; retry"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router",
        help="run the PD router (OpenAI API in front of prefill/decode workers)",
        description="Serve the OpenAI API and run each request on a prefill and a decode worker.",
    )
    parser.add_argument("--host", default=DEFAULTS.host)
    parser.add_argument("--port", type=int, default=DEFAULTS.port)
    workers = parser.add_argument_group("workers (static; more may register themselves)")
    workers.add_argument(
        "--prefill", metavar="URL", nargs="+", action="extend", default=[], help="prefill worker"
    )
    workers.add_argument(
        "--decode", metavar="URL", nargs="+", action="extend", default=[], help="decode worker"
    )
    workers.add_argument(
        "--worker",
        metavar="URL",
        nargs="+",
        action="extend",
        default=[],
        help="colocated (role both) worker",
    )
    workers.add_argument(
        "--auto",
        metavar="URL",
        nargs="+",
        action="extend",
        default=[],
        help="role auto worker: takes prefill legs, decode legs or whole requests, as the "
        "planner assigns",
    )
    policies = parser.add_argument_group("routing")
    policies.add_argument(
        "--prefill-policy", choices=PREFILL_POLICIES, default=DEFAULTS.prefill_policy
    )
    policies.add_argument(
        "--decode-policy",
        choices=DECODE_POLICIES,
        default=DEFAULTS.decode_policy,
        help="prefix-aware: KV-aware decode routing, to the decode worker that holds the "
        "longest prefix of the prompt, unless it is too much busier than the least loaded one",
    )
    policies.add_argument(
        "--prefix-block-chars",
        type=int,
        default=DEFAULTS.prefix_block_chars,
        help="prefix-aware routing: prompt block length in characters",
    )
    policies.add_argument(
        "--prefix-balance-threshold",
        type=int,
        default=DEFAULTS.prefix_balance_threshold,
        help="prefix-aware routing: how many more requests in flight a cache hit may have than "
        "the least loaded worker",
    )
    policies.add_argument(
        "--no-handoff",
        action="store_true",
        help="send every decode leg after its prefill leg (vLLM's flow), even to workers that "
        "take handoffs",
    )
    add_adaptive_arguments(parser.add_argument_group("adaptive PD"))
    security = parser.add_argument_group("security")
    security.add_argument(
        "--api-key",
        default=api_key_from_env(),
        help=API_KEY_HELP + "; sent to the workers too, which share it, unless the router has "
        "a cluster token",
    )
    security.add_argument(
        "--allowed-origins", nargs="+", default=[], metavar="ORIGIN", help=ALLOWED_ORIGINS_HELP
    )
    security.add_argument(
        "--cluster-token",
        default=cluster_token_from_env(),
        help="the cluster's shared secret: workers present it to register (without one, "
        "registration is refused), and the router sends it to its workers, which take PD "
        "fields only from its holder; needed for PD security (default: the environment "
        f"variable {CLUSTER_TOKEN_ENV}, which keeps it out of process lists)",
    )
    add_body_limit_arguments(parser.add_argument_group("request limits (a 400 or 413 beyond)"))
    add_http_arguments(parser.add_argument_group("HTTP server"))
    timing = parser.add_argument_group("timeouts and health (seconds)")
    timing.add_argument("--connect-timeout", type=float, default=DEFAULTS.connect_timeout_s)
    timing.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULTS.read_timeout_s,
        help="how long a request still waits on a worker that stopped answering its health "
        "checks before it is answered 504 (a request is never cut while its worker answers "
        "them, however long it takes)",
    )
    timing.add_argument(
        "--max-attempts",
        type=int,
        default=DEFAULTS.max_attempts,
        help="workers one leg tries before it gives up",
    )
    timing.add_argument("--health-interval", type=float, default=DEFAULTS.health_interval_s)
    timing.add_argument("--health-timeout", type=float, default=DEFAULTS.health_timeout_s)
    timing.add_argument(
        "--health-failures",
        type=int,
        default=DEFAULTS.health_failures,
        help="failed health checks in a row that take a worker out of the pool",
    )
    timing.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=DEFAULTS.heartbeat_timeout_s,
        help="a registered worker silent this long leaves the pool",
    )
    timing.add_argument(
        "--busy-poll-s",
        type=float,
        default=DEFAULTS.busy_poll_s,
        help="seconds the router's loop keeps polling without sleeping after its last request, "
        "so that the next one (and each worker's answer) finds its CPU core awake; costs a core "
        "while it polls (default: 0, off; `tandem serve` turns it on with CUDA workers)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.set_defaults(func=run)


def add_adaptive_arguments(group: argparse._ArgumentGroup) -> None:
    """Conditional disaggregation and the planner of auto workers (decide.py, planner.py)."""
    group.add_argument(
        "--disaggregation",
        choices=DISAGGREGATION_MODES,
        default=DEFAULTS.disaggregation,
        help="always: every request that allows it is disaggregated; conditional: a request "
        "goes whole to its decode worker when its uncached prompt is short, or when the "
        "prefill pool's queue is longer than the decode worker's",
    )
    group.add_argument(
        "--max-local-prefill-length",
        type=int,
        default=DEFAULTS.max_local_prefill_length,
        metavar="TOKENS",
        help="conditional: a prompt with at most this many uncached tokens (the router's "
        "estimate) is prefilled on its decode worker",
    )
    group.add_argument(
        "--max-prefill-queue-tokens",
        type=int,
        default=DEFAULTS.max_prefill_queue_tokens,
        metavar="TOKENS",
        help="conditional: a queue (prompt tokens waiting on a worker) this long is full: a "
        "longer prompt is prefilled locally while the prefill pool's queue is full and "
        "longer than the decode worker's (and its streams' TPOT p90 is under "
        "--planner-decode-tpot-high-ms), and a short one is sent to the prefill pool while "
        "the decode worker's is",
    )
    group.add_argument(
        "--planner-prefill-queue-high",
        type=int,
        default=DEFAULTS.planner_prefill_queue_high,
        metavar="TOKENS",
        help="auto workers: tokens waiting per prefill worker (the mean over --planner-dwell-s) "
        "above which one more auto worker prefills",
    )
    group.add_argument(
        "--planner-prefill-queue-low",
        type=int,
        default=DEFAULTS.planner_prefill_queue_low,
        metavar="TOKENS",
        help="auto workers: tokens waiting per worker (the mean over --planner-dwell-s) that a "
        "colocated pool must reach to split (an auto prefill worker goes back to decoding once "
        "idle for --planner-idle-s)",
    )
    group.add_argument(
        "--planner-decode-tpot-high-ms",
        type=int,
        default=DEFAULTS.planner_decode_tpot_high_ms,
        metavar="MS",
        help="auto workers: a pool that decodes and prefills on the same workers moves one to "
        "prefill once a worker's 90th percentile time per output token (its responses of the "
        "last 10 s and its streams now) reaches this: 10%% of its streams miss a TPOT SLO of "
        "this (set it to yours; 0: never), where the decode step the others would settle at "
        "is predicted well under it; conditional: a decode worker at it prefills no long prompt",
    )
    group.add_argument(
        "--planner-decode-kv-high",
        type=float,
        default=DEFAULTS.planner_decode_kv_high,
        metavar="FRACTION",
        help="auto workers: the decode workers' KV cache use above which an auto worker goes "
        "back to decoding and none leaves it",
    )
    group.add_argument(
        "--planner-dwell-s",
        type=float,
        default=DEFAULTS.planner_dwell_s,
        metavar="SECONDS",
        help="auto workers: the least time between two duty changes",
    )
    group.add_argument(
        "--planner-idle-s",
        type=float,
        default=DEFAULTS.planner_idle_s,
        metavar="SECONDS",
        help="auto workers: how long the prefill workers must have had no request in flight "
        "(their idle_ms) before an auto one goes back to decoding",
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        host=args.host,
        port=args.port,
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        both_urls=tuple(args.worker),
        auto_urls=tuple(args.auto),
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        api_key=args.api_key,
        allowed_origins=tuple(args.allowed_origins),
        cluster_token=args.cluster_token or None,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        max_attempts=args.max_attempts,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        health_failures=args.health_failures,
        heartbeat_timeout_s=args.heartbeat_timeout,
        prefix_block_chars=args.prefix_block_chars,
        prefix_balance_threshold=args.prefix_balance_threshold,
        handoff=not args.no_handoff,
        disaggregation=args.disaggregation,
        max_local_prefill_length=args.max_local_prefill_length,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        planner_prefill_queue_high=args.planner_prefill_queue_high,
        planner_prefill_queue_low=args.planner_prefill_queue_low,
        planner_decode_tpot_high_ms=args.planner_decode_tpot_high_ms,
        planner_decode_kv_high=args.planner_decode_kv_high,
        planner_dwell_s=args.planner_dwell_s,
        planner_idle_s=args.planner_idle_s,
        busy_poll_s=args.busy_poll_s,
        body_limits=body_limits_from_args(args),
        log_level=args.log_level,
    )


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from tandem.http_options import quiet_probes, under_root_path, uvicorn_options
    from tandem.keep_awake import KeepAwake
    from tandem.router.app import create_app
    from tandem.router.relay import error_body
    from tandem.shutdown_cut import EndCutAnswers

    check_http_args(args, "router")
    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    quiet_probes()
    cut_ending = error_body(SHUTTING_DOWN, "server_error", "router_shutting_down")
    app = EndCutAnswers(create_app(config), cut_ending)
    uvicorn.run(
        under_root_path(KeepAwake(app, config.busy_poll_s), args.root_path),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **uvicorn_options(args),
    )
    return 0
