"""Start a worker: the engine core process (two for role pd: prefill and decode), the HTTP
server, and (with --router) heartbeats.

SIGTERM or SIGINT stop accepting connections, let in-flight responses finish for a short grace
period, abort what is left (each answer ended in words: `tandem.shutdown_cut`), wait until the KV
its prefills leased is collected (the KV port stays open; at most the grace period again), stop
the engine process and exit 0. An engine process that dies makes the worker unhealthy at once
(503s, in-flight requests included), and the worker exits with ENGINE_DIED_EXIT_CODE a moment
later, for its supervisor to restart it.

The HTTP server takes vLLM's server flags (`tandem.http_options`): a root path, TLS, one access
line per request unless disabled, and uvicorn's log level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from pathlib import Path

import msgspec
import uvicorn

from tandem.engine.config import EngineConfig
from tandem.http_options import quiet_probes, under_root_path, url_scheme, uvicorn_options
from tandem.keep_awake import KeepAwake
from tandem.kv.config import KVTransferConfig
from tandem.limits import body_limits_from_args, field_limits_from_args
from tandem.server.app import build_app
from tandem.server.engine_client import AsyncEngineClient, EngineStartError
from tandem.server.openai.protocol import error_body
from tandem.server.pd_client import DisaggregatedClient, place_engines
from tandem.server.settings import ServerSettings
from tandem.shutdown_cut import EndCutAnswers

logger = logging.getLogger("tandem.worker")
GRACEFUL_SHUTDOWN_S = 10
SHUTTING_DOWN = "the server is shutting down and cut this request short; retry"
ENGINE_DIED_EXIT_CODE = 3
# between an engine's death and the exit: its requests' 503s go out, health checks see it
ENGINE_DIED_EXIT_DELAY_S = 1.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # listen on every address: no address a peer can reach


def kv_config_from_args(args: argparse.Namespace) -> KVTransferConfig | None:
    if args.role == "both" and args.kv_transport is None:
        return None
    kv_role = "both" if args.role == "auto" else args.role  # auto: serves and loads KV
    kv_host = args.kv_host or args.host
    if kv_host in WILDCARD_HOSTS:
        raise SystemExit(
            f"tandem worker: the KV port would tell its peers to reach it at {kv_host!r}, which "
            "no other host can: pass --kv-host with the address peers reach this worker at"
        )
    return kv_config_of(args, kv_role, args.kv_transport or "tcp", kv_host)


def advertised_url(args: argparse.Namespace, url: str) -> str:
    """The URL this worker gives its router: --advertise-url, else the one it serves on."""
    if args.router and not args.advertise_url and args.host in WILDCARD_HOSTS:
        raise SystemExit(
            f"tandem worker: --host {args.host!r} is no address the router can reach: pass "
            "--advertise-url with the URL the router should use"
        )
    return args.advertise_url or url


def kv_config_of(
    args: argparse.Namespace, role: str, transport: str, host: str
) -> KVTransferConfig:
    return KVTransferConfig(
        role=role,
        transport=transport,
        host=host,
        port=args.kv_port,
        lease_timeout_s=args.kv_lease_timeout,
        transfer_timeout_s=args.kv_transfer_timeout,
        load_failure_policy=args.kv_load_failure_policy,
        cluster_token=args.cluster_token or None,
    )


def disaggregated_client(args: argparse.Namespace, config: EngineConfig) -> DisaggregatedClient:
    """Role pd: a prefill engine and a decode engine behind this one server."""
    prefill_config, decode_config = place_engines(config, args.decode_device)
    on_gpus = prefill_config.device.startswith("cuda") and decode_config.device.startswith("cuda")
    transport = args.kv_transport or ("cuda-ipc" if on_gpus else "tcp")
    if transport == "cuda-ipc" and not on_gpus:
        raise SystemExit("tandem worker: --kv-transport cuda-ipc needs both engines on GPUs")
    host = args.kv_host or "127.0.0.1"
    return DisaggregatedClient(
        AsyncEngineClient(prefill_config, kv_config_of(args, "prefill", transport, host)),
        AsyncEngineClient(decode_config, kv_config_of(args, "decode", transport, host)),
    )


def read_chat_template(value: str) -> str:
    """--chat-template's template: the value itself when it is Jinja, else the file it names."""
    if "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).expanduser().read_text()
    except OSError as exc:
        raise SystemExit(
            f"tandem worker: --chat-template {value!r} is not a Jinja template, and no file "
            f"of that name can be read ({exc.strerror})"
        ) from None


def configure_logging() -> None:
    """The worker's log: INFO and up, timed, to stderr (once; later calls change nothing);
    httpx's line per request (the router heartbeats, each second) only from WARNING."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    serve_started = time.monotonic()
    configure_logging()
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("tandem worker: --enable-auto-tool-choice needs --tool-call-parser")
    if args.role == "pd":
        kv_config = None  # the two engines' transfers stay inside this server
        client = disaggregated_client(args, config)
    else:
        kv_config = kv_config_from_args(args)
        client = AsyncEngineClient(config, kv_config)
    settings = ServerSettings(
        served_model_name=(args.served_model_name or [config.model])[0],
        model_aliases=tuple((args.served_model_name or [])[1:]),
        role=args.role,
        kv_transport=kv_config.transport if kv_config else None,
        kv_host=kv_config.host if kv_config else None,
        use_generation_config=args.generation_config == "auto",
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
        chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
        trust_request_chat_template=args.trust_request_chat_template,
        api_key=args.api_key,
        cluster_token=args.cluster_token or None,
        allowed_origins=tuple(args.allowed_origins),
        scheduling_policy=config.scheduling_policy,
        body_limits=body_limits_from_args(args),
        field_limits=field_limits_from_args(args),
        max_waiting=config.max_waiting,
        max_logprobs=args.max_logprobs,
    )
    if kv_config is not None and not args.cluster_token:
        logger.warning(
            "no cluster token: anyone who reaches this worker may send it PD fields "
            "(kv_transfer_params, /v1/kv/release) and use its KV port; pass --cluster-token "
            "(or set TANDEM_CLUSTER_TOKEN) on every worker and the router"
        )
    url = f"{url_scheme(args)}://{args.host}:{args.port}"
    worker_url = advertised_url(args, url)
    started = {"ok": False}
    engine_death: dict[str, str] = {}

    def on_engine_death(cause: str) -> None:
        engine_death["cause"] = cause
        logger.error(
            "the engine process died (%s): this worker answers 503 and exits with code %d",
            cause,
            ENGINE_DIED_EXIT_CODE,
        )
        asyncio.get_running_loop().call_later(
            ENGINE_DIED_EXIT_DELAY_S, setattr, server, "should_exit", True
        )

    client.death_listener = on_engine_death

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            await client.start()
        except EngineStartError as exc:
            logger.error("the engine could not start: %s", exc)
            raise
        started["ok"] = True
        if settings.use_generation_config and client.sampling_defaults:
            logger.info(
                "sampling defaults from the model's generation_config.json: %s "
                "(requests override them; --generation-config none ignores them)",
                client.sampling_defaults,
            )
        gc.collect()  # start-up's objects (the tokenizer's above all) stay: out of the GC's walk
        gc.freeze()
        heartbeat = None
        if args.router:
            from tandem.router.registration import HeartbeatSender

            heartbeat = HeartbeatSender(
                router_url=args.router,
                worker_url=worker_url,
                role="both" if args.role == "pd" else args.role,  # to a router: whole requests
                model=settings.served_model_name,
                token=args.cluster_token,
            )
            heartbeat.start()
        logger.info(
            "worker ready on %s%s (role %s) in %.1f s",
            url,
            args.root_path,
            args.role,
            time.monotonic() - serve_started,
        )
        try:
            yield
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            if settings.kv_transport is not None and args.role != "pd":
                # what it leased goes to its decode workers (over the KV port) before it stops
                await client.settle_leases(min(args.kv_lease_timeout, GRACEFUL_SHUTDOWN_S))
            await client.shutdown()

    app = build_app(client, settings)
    app.router.lifespan_context = lifespan
    cut_ends = EndCutAnswers(app, msgspec.json.encode(error_body(SHUTTING_DOWN, 503)))
    quiet_probes()
    server = uvicorn.Server(
        uvicorn.Config(
            under_root_path(KeepAwake(cut_ends, config.busy_poll_seconds()), args.root_path),
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            **uvicorn_options(args),
        )
    )
    # uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done, which would end the
    # process with the signal's status; a drained worker exits 0 instead.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    server.run()
    if not started["ok"]:
        print("tandem worker: the engine could not start (see the log above)", file=sys.stderr)
        return 1
    if engine_death:
        print(f"tandem worker: the engine process died ({engine_death['cause']})", file=sys.stderr)
        return ENGINE_DIED_EXIT_CODE
    return 0
