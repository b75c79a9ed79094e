"""`tandem serve`: a router and its workers on this host, from flags or a cluster YAML file
(on a Ray cluster with `--ray` or the file's `ray:` section: `tandem.launcher.ray_cluster`).

Flags given on the command line override the file; without a file, the cluster is one prefill
and one decode worker on the default model; the KV transport is GPU-direct (cuda-ipc) when the
workers run on GPUs, TCP otherwise. The model comes positionally (`tandem serve MODEL`, as
`vllm serve MODEL`) or as `--model`. Every flag `tandem worker` takes alike on each worker of a
cluster (`tandem.server.worker_flags`: engine, front end, limits, KV lease) is a `tandem serve`
flag too, with the same values, given to every worker when given: those a cluster file has keys
for (`EngineSettings`) as the roles' engine settings, the others after each role's extra_args.
Secrets come from flags or the environment, never from the file: the cluster token
(`--cluster-token`, else $TANDEM_CLUSTER_TOKEN, else a fresh random one) and the API key reach
every child in its environment. Imports only argparse and the standard library at import time.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import Any

# the router's tuning of conditional disaggregation and of the planner, flags of `tandem serve`
# and keys of a cluster file's `router:` (name, type); `tandem router --help` says what each does
ROUTER_TUNING = (
    ("max_local_prefill_length", int),
    ("max_prefill_queue_tokens", int),
    ("planner_prefill_queue_high", int),
    ("planner_prefill_queue_low", int),
    ("planner_decode_tpot_high_ms", int),
    ("planner_decode_kv_high", float),
    ("planner_dwell_s", float),
    ("planner_idle_s", float),
)

DEFAULT_CLUSTER: dict[str, Any] = {
    "roles": {
        "prefill": {"count": 1, "engine": {"kv_transport": "auto"}},
        "decode": {"count": 1, "engine": {"kv_transport": "auto"}},
    }
}


class _RecordingGroup:
    """Stands for a parser or one of its argument groups: adds the flags it is given there, each
    unset unless given (default SUPPRESS), its groups to the parser, titled as every worker's;
    and remembers every flag it added."""

    def __init__(
        self,
        parser: argparse.ArgumentParser,
        container: argparse._ActionsContainer,
        added: list[argparse.Action],
    ) -> None:
        self.parser = parser
        self.container = container
        self.added = added

    def add_argument(self, *flags: str, **settings: Any) -> argparse.Action:
        action = self.container.add_argument(*flags, **{**settings, "default": argparse.SUPPRESS})
        self.added.append(action)
        return action

    def add_argument_group(self, title: str) -> _RecordingGroup:
        group = self.parser.add_argument_group(f"every worker: {title}")
        return _RecordingGroup(self.parser, group, self.added)


def add_worker_flags(parser: argparse.ArgumentParser) -> tuple[argparse.Action, ...]:
    """`tandem worker`'s shared flags on `parser`, unset unless given."""
    from tandem.server.worker_flags import add_worker_arguments

    added: list[argparse.Action] = []
    add_worker_arguments(_RecordingGroup(parser, parser, added))
    return tuple(added)


def as_worker_args(action: argparse.Action, value: Any) -> list[str]:
    """A parsed flag's value as the worker's command line takes it."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[0 if value else 1]]
    if action.nargs == 0:  # store_true
        return [action.option_strings[0]]
    values = value if isinstance(value, list) else [value]
    return [action.option_strings[0], *map(str, values)]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start a router and its workers on this host (or on a Ray cluster: --ray)",
        description="Start a router and prefill/decode workers, wait until all are healthy, "
        "restart any that exits, and stop all of them on Ctrl-C or SIGTERM. The flags of "
        "every worker are tandem worker's, given to each worker when given (over a cluster "
        "file's values; the worker's defaults otherwise).",
    )
    from tandem.engine.cli import add_model_arguments
    from tandem.http_options import (
        add_keep_alive_argument,
        add_request_log_argument,
        positive_seconds,
    )

    add_model_arguments(parser, "default: the cluster file's, else smollm2-135m-instruct")
    parser.add_argument("--config", metavar="CLUSTER_YAML", help="cluster description file")
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
        "--auto",
        type=int,
        metavar="N",
        help="auto workers: prefill, decode or whole requests as the router's planner assigns "
        "(default 0)",
    )
    parser.add_argument(
        "--prefill-tp",
        type=_positive_int,
        metavar="N",
        help="the prefill workers' --tensor-parallel-size, over -tp (which sets every worker's)",
    )
    parser.add_argument(
        "--decode-tp",
        type=_positive_int,
        metavar="N",
        help="the decode workers' --tensor-parallel-size, over -tp (which sets every worker's)",
    )
    parser.add_argument(
        "--disaggregation",
        choices=("always", "conditional"),
        help="the router's: conditional serves short prompts whole (see tandem router --help)",
    )
    parser.add_argument(
        "--prefill-policy",
        choices=("prefix-aware", "least-outstanding", "round-robin"),
        help="the router's choice of prefill worker (see tandem router --help)",
    )
    parser.add_argument(
        "--decode-policy",
        choices=("least-outstanding", "round-robin", "prefix-aware"),
        help="the router's choice of decode worker; prefix-aware sends a conversation's next "
        "turn where its KV already is (see tandem router --help)",
    )
    for name, kind in ROUTER_TUNING:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            metavar="VALUE",
            help="the router's (see tandem router --help)",
        )
    parser.add_argument(
        "--pd",
        type=int,
        metavar="N",
        help="servers that each run a prefill and a decode engine (two GPUs), seen by the router "
        "as colocated workers (default 0; with --prefill 0 --decode 0 for them alone)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default: auto")
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the cluster on Ray: each process an actor, placed as the cluster file's ray "
        "section says (docs/deploy.md); ADDRESS is ray.init's (default: the file's "
        "ray.address, else $RAY_ADDRESS, else a Ray started on this host, else a new one)",
    )
    parser.add_argument(
        "--kv-transport",
        choices=("auto", "tcp", "cuda-ipc", "nixl", "mooncake"),
        help="KV transport of prefill and decode (default auto: cuda-ipc on GPUs of this host, "
        "else tcp; nixl and mooncake when named)",
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
    parser.add_argument("--host", help="the router's bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="the router's port (default 8000)")
    parser.add_argument(
        "--root-path",
        metavar="PREFIX",
        help="the router serves under this path prefix too (see tandem router --help)",
    )
    add_request_log_argument(parser)
    add_keep_alive_argument(parser, default=None, whose=", on the router and every worker")
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
        "--unresponsive-timeout",
        type=positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a process that was healthy and then answers no health check for this long (it "
        "is stopped, deadlocked, swapped out) is killed and restarted as a crashed one is "
        "(default 30)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=30.0,
        help="seconds a process gets to exit after SIGTERM before SIGKILL (default 30: a "
        "worker's own stop takes up to 10 s for its answers and 10 s for its KV leases)",
    )
    parser.set_defaults(func=run, worker_flags=add_worker_flags(parser))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def given_worker_flags(args: argparse.Namespace) -> dict[str, tuple[argparse.Action, Any]]:
    """The worker flags given on the command line, by name (argparse's dest). The tool call
    parser only with --enable-auto-tool-choice, which a cluster's tool_call_parser implies: the
    parser alone does not turn "auto" on, as in the worker."""
    given = {
        action.dest: (action, getattr(args, action.dest))
        for action in args.worker_flags
        if hasattr(args, action.dest)
    }
    if "enable_auto_tool_choice" not in given:
        given.pop("tool_call_parser", None)
    given.pop("enable_auto_tool_choice", None)
    return given


def cluster_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted keys that the flags given on the command line set."""
    from tandem.engine.cli import model_of
    from tandem.launcher.cluster import WORKER_ROLES, EngineSettings

    settings = {
        dest: value
        for dest, (_, value) in given_worker_flags(args).items()
        if dest in EngineSettings.model_fields
    }
    flags = {
        "model": model_of(args, "serve"),
        "served_model_name": args.served_model_name,
        "device": args.device,
        "roles.prefill.count": args.prefill,
        "roles.decode.count": args.decode,
        "roles.both.count": args.both,
        "roles.pd.count": args.pd,
        "roles.auto.count": args.auto,
        "router.disaggregation": args.disaggregation,
        "router.prefill_policy": args.prefill_policy,
        "router.decode_policy": args.decode_policy,
        **{f"router.{name}": getattr(args, name) for name, _ in ROUTER_TUNING},
        "roles.prefill.engine.kv_transport": args.kv_transport,
        "roles.decode.engine.kv_transport": args.kv_transport,
        "roles.pd.engine.kv_transport": args.kv_transport,
        **{
            f"roles.{role}.engine.{field}": value
            for field, value in settings.items()
            for role in WORKER_ROLES
        },
        "router.host": args.host,
        "router.allowed_origins": args.allowed_origins,
        "ports.router": args.port,
        "ports.workers": args.worker_port_base,
        "ports.kv": args.kv_port_base,
        "ray.address": args.ray or None,
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    for role in ("prefill", "decode"):  # over every worker's -tp
        if (size := getattr(args, f"{role}_tp")) is not None:
            flags[f"roles.{role}.engine.tensor_parallel_size"] = size
    return flags


def worker_extra_args(args: argparse.Namespace) -> list[str]:
    """The given worker flags that a cluster file has no key for, as worker arguments."""
    from tandem.launcher.cluster import EngineSettings

    extra = [
        arg
        for dest, (action, value) in given_worker_flags(args).items()
        if dest not in EngineSettings.model_fields
        for arg in as_worker_args(action, value)
    ]
    return extra + shared_http_args(args)


def router_extra_args(args: argparse.Namespace) -> list[str]:
    extra = ["--root-path", args.root_path] if args.root_path else []
    return extra + shared_http_args(args)


def shared_http_args(args: argparse.Namespace) -> list[str]:
    """The HTTP server flags given to serve that the router and every worker take alike."""
    shared = ["--disable-log-requests"] if args.disable_log_requests else []
    if args.timeout_keep_alive is not None:
        shared += ["--timeout-keep-alive", str(args.timeout_keep_alive)]
    return shared


def cluster_data(args: argparse.Namespace) -> Any:
    """The cluster's description as plain data: the file's (or the default one) with the flags
    given on the command line over it, the worker and router flags it has no key for after its
    extra_args."""
    from tandem.launcher.cluster import (
        WORKER_ROLES,
        append_args,
        load_cluster_file,
        merge_overrides,
    )

    data = load_cluster_file(args.config) if args.config else DEFAULT_CLUSTER
    data = merge_overrides(data, cluster_overrides(args))
    for role in WORKER_ROLES:
        data = append_args(data, f"roles.{role}.engine.extra_args", worker_extra_args(args))
    return append_args(data, "router.extra_args", router_extra_args(args))


def run(args: argparse.Namespace) -> int:
    from tandem.access import cluster_token_from_env
    from tandem.launcher.cluster import ClusterError, parse_cluster
    from tandem.launcher.plan import (
        check_model_splits,
        child_environment,
        plan_processes,
        resolve_device,
    )
    from tandem.launcher.supervisor import Supervisor

    if hasattr(args, "enable_auto_tool_choice") and not hasattr(args, "tool_call_parser"):
        print("tandem serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    try:
        spec = parse_cluster(cluster_data(args), args.config)
        on_ray = args.ray is not None or spec.ray is not None  # devices: those of Ray's nodes
        device, num_gpus = ("a Ray cluster", 0) if on_ray else resolve_device(spec.device)
        check_model_splits(spec)
        plans = [] if on_ray else plan_processes(spec, device, num_gpus)
    except (ClusterError, RuntimeError) as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    cluster_token = args.cluster_token or cluster_token_from_env()
    roles = spec.roles
    print(
        f"tandem serve: starting {spec.model} on {device}: {roles.prefill.count} prefill, "
        f"{roles.decode.count} decode, {roles.both.count} both, {roles.pd.count} pd, "
        f"{roles.auto.count} auto",
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
    if on_ray:
        from tandem.launcher.ray_cluster import serve_on_ray

        return serve_on_ray(
            spec,
            child_environment({}, cluster_token, args.api_key),
            startup_timeout_s=args.startup_timeout,
            stop_timeout_s=args.stop_timeout,
            max_start_failures=args.max_start_failures,
            unresponsive_timeout_s=args.unresponsive_timeout,
        )
    env = child_environment(os.environ, cluster_token, args.api_key)
    supervisor = Supervisor(
        plans,
        startup_timeout_s=args.startup_timeout,
        stop_timeout_s=args.stop_timeout,
        max_start_failures=args.max_start_failures,
        unresponsive_timeout_s=args.unresponsive_timeout,
        env=env,
    )
    return supervisor.run()
