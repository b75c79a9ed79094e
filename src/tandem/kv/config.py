"""KV-transfer settings of one worker, frozen; the connector is built from them in the engine
core process."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tandem.kv.data import DATA_PLANES

ROLES = ("prefill", "decode", "both")
TRANSPORTS = tuple(DATA_PLANES)
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    role: str  # prefill: serves its KV; decode: loads remote KV; both: either
    transport: str = "tcp"
    host: str = "127.0.0.1"  # where the KV server listens and what decode workers are told
    port: int = 0  # 0: any free port
    lease_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    handoff_timeout_s: float = 600.0  # how long a decode waits for a prefill it was handed off
    load_failure_policy: str = "recompute"
    # the cluster's shared secret: KV connections prove it both ways (tandem.kv.control.auth)
    cluster_token: str | None = field(default=None, repr=False)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, not {self.transport!r}")
        if self.load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv load failure policy must be one of {FAILURE_POLICIES}")
        if self.lease_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("KV lease and transfer timeouts must be positive")

    @property
    def serves_kv(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def loads_kv(self) -> bool:
        return self.role in ("decode", "both")
