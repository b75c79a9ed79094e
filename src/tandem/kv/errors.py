"""The one error type of KV transfers, raised by the control plane and every data plane.

`KVTransferError.kind` says what went wrong, and is what a load's failure reports (metrics
count it under that kind): "timeout" (a deadline passed), "connection" (could not connect, or
the connection broke or carried something that is not the protocol), "not_found" (the prefill
has no transfer under that id), "aborted" (the transfer was withdrawn, its prefill gave up, or
the wait was cancelled), "mismatch" (the two sides' layouts or sizes differ).
"""

from __future__ import annotations

from typing import Literal, get_args

KVTransferErrorKind = Literal["timeout", "connection", "not_found", "aborted", "mismatch"]
TRANSFER_ERROR_KINDS: tuple[str, ...] = get_args(KVTransferErrorKind)


class KVTransferError(RuntimeError):
    def __init__(self, kind: KVTransferErrorKind, message: str) -> None:
        if kind not in TRANSFER_ERROR_KINDS:
            raise ValueError(f"unknown KV transfer error kind {kind!r}")
        super().__init__(f"{kind}: {message}")
        self.kind: KVTransferErrorKind = kind
