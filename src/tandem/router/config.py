"""The router's settings, resolved once from the command line and frozen.

Every timeout is in seconds. Worker URLs are stored without a trailing slash, so that a URL names
one worker however it was written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.limits import BodyLimits

# auto: a worker that serves prefill legs, decode legs and whole requests; the planner says
# which of them it takes now (planner.py)
Role = Literal["prefill", "decode", "both", "auto"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both", "auto")
DISAGGREGATION_MODES = ("always", "conditional")

PREFILL_POLICIES = ("prefix-aware", "least-outstanding", "round-robin")
DECODE_POLICIES = ("least-outstanding", "round-robin", "prefix-aware")


def normalize_url(url: str) -> str:
    """The canonical spelling of a worker URL: scheme included, no trailing slash."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    both_urls: tuple[str, ...] = ()
    auto_urls: tuple[str, ...] = ()
    prefill_policy: str = "prefix-aware"
    decode_policy: str = "least-outstanding"
    api_key: str | None = None  # what clients must send
    allowed_origins: tuple[str, ...] = ()  # browser origins answered (CORS)
    # the cluster's secret: what registering workers send, and what the router sends workers
    cluster_token: str | None = None
    # Upstream calls: connecting; and how long a leg (prefill, decode or plain) still waits on
    # a worker out of the pool whose health checks go unanswered. No leg is cut while its worker
    # answers them, however long its request takes (workers.py).
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0
    # How many workers one leg tries before it gives up.
    max_attempts: int = 3
    # Health checks of every known worker, and the heartbeat deadline of registered ones.
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    health_failures: int = 2
    heartbeat_timeout_s: float = 3.0
    # Prefix-aware routing: prompt block length in characters (or token ids for token prompts),
    # and how many more outstanding requests a cache hit may have than the least loaded worker.
    prefix_block_chars: int = 64
    prefix_balance_threshold: int = 16
    # Conditional disaggregation (decide.py): `always` disaggregates every body that allows it;
    # `conditional` prefills on the decode worker a prompt of at most `max_local_prefill_length`
    # uncached tokens, and keeps a longer one local while the prefill pool's shortest queue
    # holds more than `max_prefill_queue_tokens` tokens and the decode worker's holds fewer.
    disaggregation: str = "always"
    max_local_prefill_length: int = 512
    max_prefill_queue_tokens: int = 8192
    # The planner of `auto` workers (planner.py): tokens waiting per prefill worker above which
    # one more prefills, and per worker the least at which a colocated pool splits (both the
    # mean over the dwell time); the TPOT (a decode worker's p90) at which it splits (0: never);
    # the decode side's KV cache use above which none leaves it; the least time between two
    # changes, over which the queues are read; how long the prefill side idles before one of
    # its auto workers goes back to decoding.
    planner_prefill_queue_high: int = 4096
    planner_prefill_queue_low: int = 512
    planner_decode_tpot_high_ms: int = 50
    planner_decode_kv_high: float = 0.8
    planner_dwell_s: float = 5.0
    planner_idle_s: float = 15.0
    # Streamed PD requests send both legs at once where the workers take handoffs.
    handoff: bool = True
    # How long the router's loop keeps polling without sleeping after its last request (0: off).
    busy_poll_s: float = 0.0
    body_limits: BodyLimits = BodyLimits()  # a client body's size and JSON depth
    log_level: str = "info"

    @property
    def worker_bearer(self) -> str | None:
        """The bearer token of the router's calls to workers: the cluster token, which lets
        its requests through a worker's API key and lets them carry PD fields; else the API
        key, which the workers share."""
        return self.cluster_token or self.api_key

    def streams_slowed(self, tpot_p90_ms: int) -> bool:
        """Whether a decode worker's TPOT p90 is at the planner's mark (never with mark 0)."""
        return 0 < self.planner_decode_tpot_high_ms <= tpot_p90_ms

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls", "both_urls", "auto_urls"):
            urls = tuple(dict.fromkeys(normalize_url(url) for url in getattr(self, name)))
            object.__setattr__(self, name, urls)
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"unknown prefill policy {self.prefill_policy!r}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"unknown decode policy {self.decode_policy!r}")
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"unknown disaggregation mode {self.disaggregation!r}")
        if self.max_local_prefill_length < 0 or self.max_prefill_queue_tokens < 0:
            raise ValueError("the conditional disaggregation thresholds must be 0 or more")
        if not 0 <= self.planner_prefill_queue_low <= self.planner_prefill_queue_high:
            raise ValueError("planner_prefill_queue_low must be between 0 and the high mark")
        if self.planner_decode_tpot_high_ms < 0:
            raise ValueError("planner_decode_tpot_high_ms must be 0 or more")
        if self.planner_dwell_s < 0 or self.planner_idle_s < 0:
            raise ValueError("planner_dwell_s and planner_idle_s must be 0 or more")
        if self.busy_poll_s < 0:
            raise ValueError("busy_poll_s must be 0 or more")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.read_timeout_s <= 0:
            raise ValueError("read_timeout_s must be more than 0")
