"""The worker HTTP server's settings, resolved once from the command line and frozen."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.limits import BodyLimits, FieldLimits


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str  # the model's name in answers
    model_aliases: tuple[str, ...] = ()  # more names requests may use
    role: str = "both"
    kv_transport: str | None = None  # tcp | cuda-ipc; None: no KV transfer (a colocated worker)
    kv_host: str | None = None
    # the model's generation config gives the defaults of sampling fields a request leaves out
    use_generation_config: bool = True
    tool_call_parser: str | None = None  # tool_choice "auto" answered with calls in this format
    reasoning_parser: str | None = None  # chat answers' reasoning split off in this format
    chat_template: str | None = None  # used instead of the model's
    trust_request_chat_template: bool = False  # a request may bring its own template
    api_key: str | None = None  # wanted as a bearer token on all but the open endpoints
    # the cluster's secret: with it, only requests bearing it may set PD fields or release KV
    cluster_token: str | None = None
    allowed_origins: tuple[str, ...] = ()  # browser origins answered (CORS)
    scheduling_policy: str = "fcfs"  # the engine's: a request's priority counts under "priority"
    body_limits: BodyLimits = BodyLimits()  # a request body's size and JSON depth
    field_limits: FieldLimits = FieldLimits()  # stop strings, logit_bias, structured outputs
    max_waiting: int = 1024  # the engine's queue: the most sequences one request may start
    max_logprobs: int = 20  # the most logprobs per token a request may ask for (-1: the vocabulary)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request's `model` may give."""
        return (self.served_model_name, *self.model_aliases)
