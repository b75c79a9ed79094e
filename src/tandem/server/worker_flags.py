"""The flags every worker of a cluster takes alike: the engine's, the front end's, the request
limits and the KV lease's. `tandem worker` declares them, and `tandem serve` declares the same
ones (same names, values and help) and gives each one given to every worker.

Imports only argparse and the modules that name the flags' values, so that the CLIs load fast.
"""

from __future__ import annotations

import argparse

from tandem.engine.cli import add_engine_arguments
from tandem.limits import add_body_limit_arguments, add_field_limit_arguments
from tandem.server.reasoning import REASONING_PARSERS
from tandem.server.tool_calls import TOOL_CALL_PARSERS

# The defaults of the flags --kv-transfer-config maps to: a flag away from its default was given.
KV_FLAG_DEFAULTS = {
    "role": "both",
    "kv_transport": None,
    "kv_host": None,
    "kv_port": 0,
    "kv_load_failure_policy": "recompute",
}
LOAD_FAILURE_POLICIES = ("recompute", "fail")  # vLLM's kv_load_failure_policy values
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's


def add_worker_arguments(parser: argparse._ActionsContainer) -> None:
    """The flags every worker of a cluster takes alike: the engine's, the front end's, the
    request limits and the KV lease's."""
    add_engine_arguments(parser)
    front_end = parser.add_argument_group("front end")
    front_end.add_argument(
        "--max-logprobs",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        metavar="N",
        help="the most logprobs per token a request may ask for (logprobs, top_logprobs, "
        "prompt_logprobs); more is a 400 (-1: the whole vocabulary; default: 20, vLLM's)",
    )
    front_end.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "none"],
        help="auto: sampling fields a request leaves out take the values of the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), as "
        "vLLM does; none: tandem's defaults",
    )
    front_end.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=UVICORN_LOG_LEVELS,
        help="the HTTP server's log level (info: one line per request, unless "
        "--disable-log-requests)",
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
    tools = parser.add_argument_group("tool calls and reasoning")
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
    tools.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split chat answers' reasoning off their content (message and delta field "
        "`reasoning`, and `reasoning_content`): deepseek_r1 (DeepSeek-R1, QwQ), qwen3",
    )
    limits = parser.add_argument_group("request limits (a request over one is a 400 or 413)")
    add_body_limit_arguments(limits)
    add_field_limit_arguments(limits)
    lease = parser.add_argument_group("KV transfer timing (PD)")
    lease.add_argument(
        "--kv-lease-timeout",
        type=float,
        default=30.0,
        help="seconds a prefill worker holds a request's KV for its decode worker",
    )
    lease.add_argument(
        "--kv-transfer-timeout", type=float, default=30.0, help="seconds one KV transfer may take"
    )
    lease.add_argument(
        "--kv-load-failure-policy",
        default=KV_FLAG_DEFAULTS["kv_load_failure_policy"],
        choices=LOAD_FAILURE_POLICIES,
        help="a decode worker whose KV load fails recomputes the prompt, or fails the request",
    )
