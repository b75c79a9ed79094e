"""`tandem worker`: one engine behind the OpenAI-compatible HTTP server, in role prefill, decode
or both; or, in role pd, a prefill engine and a decode engine behind one server."""

from __future__ import annotations

import argparse

from tandem.access import (
    ALLOWED_ORIGINS_HELP,
    API_KEY_HELP,
    CLUSTER_TOKEN_ENV,
    api_key_from_env,
    cluster_token_from_env,
)
from tandem.engine.cli import add_engine_arguments, engine_config_from_args
from tandem.limits import add_body_limit_arguments, add_field_limit_arguments
from tandem.server.reasoning import REASONING_PARSERS
from tandem.server.tool_calls import TOOL_CALL_PARSERS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("worker", help="serve one engine over the OpenAI API")
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name in the API (default: --model); with several, answers carry the "
        "first and requests may use any",
    )
    parser.add_argument("--api-key", default=api_key_from_env(), help=API_KEY_HELP)
    parser.add_argument(
        "--allowed-origins", nargs="+", default=[], metavar="ORIGIN", help=ALLOWED_ORIGINS_HELP
    )
    parser.add_argument(
        "--role",
        default="both",
        choices=["prefill", "decode", "both", "pd"],
        help="pd: a prefill engine and a decode engine behind this one server, the KV handed "
        "over between them (cuda-ipc on GPUs, else tcp)",
    )
    parser.add_argument(
        "--decode-device",
        default="auto",
        help="role pd: the decode engine's device (auto: the GPU after --device's when there "
        "is one, else the same device)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "none"],
        help="auto: sampling fields a request leaves out take the values of the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), as "
        "vLLM does; none: tandem's defaults",
    )
    chat = parser.add_argument_group("chat template")
    chat.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="a Jinja chat template, or the path of a file holding one, used instead of the "
        "model's (for a model without one, or to change it)",
    )
    chat.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="take a request's own chat_template; without this, such a request is refused",
    )
    tools = parser.add_argument_group("tool calls")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='answer tool_choice "auto" (the default when a request has tools): the model '
        "writes calls in its own format, found by --tool-call-parser",
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="the model's tool call format: hermes (Qwen2.5, Qwen3, Hermes, SmolLM2), "
        "llama3_json (Llama 3.1, 3.2), mistral (Mistral; keeps special tokens in the text), "
        "pythonic (Llama 3.2 and 4 pythonic templates, ToolACE)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split chat answers' reasoning off their content (message and delta field "
        "`reasoning`, and `reasoning_content`): deepseek_r1 (DeepSeek-R1, QwQ), qwen3",
    )
    limits = parser.add_argument_group("request limits (a request over one is a 400 or 413)")
    add_body_limit_arguments(limits)
    add_field_limit_arguments(limits)
    kv = parser.add_argument_group("KV transfer (PD)")
    kv.add_argument("--kv-transport", default=None, choices=["tcp", "cuda-ipc"])
    kv.add_argument("--kv-host", default=None, help="address decode workers reach (default --host)")
    kv.add_argument("--kv-port", type=int, default=0, help="KV server port (0: any free port)")
    kv.add_argument("--kv-lease-timeout", type=float, default=30.0, help="seconds")
    kv.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds")
    kv.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"])
    kv.add_argument("--kv-fault", default=None, help=argparse.SUPPRESS)  # fault injection, tests
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
    from tandem.server.main import serve

    return serve(args, engine_config_from_args(args))
