"""What every KV transport offers the connector: a server, a client, errors and fault injection.

A transport moves the bytes of per-layer staging tensors from the prefill worker (server side) to
the decode worker (client side) and reports what happened; the connector does the bookkeeping
(which blocks, leases, freeing). Invariants every implementation keeps:

* `publish` and `withdraw` never wait on the network: the engine loop calls them.
* Layer i is delivered only after the publisher's `wait_layer(i)` returned, and layers arrive in
  order, so decode can consume early layers while prefill is still producing later ones.
* `on_transfer_done(transfer_id, True)` is called once, when a decode worker confirmed it received
  every layer; the transfer is then forgotten. `on_transfer_done(transfer_id, False)` is called
  each time a fetch of a still-published transfer breaks; the transfer stays published, the
  connector decides whether to withdraw it or let decode retry.
* Every failure a fetch reports is a `KVTransferError` whose `kind` says what went wrong.
* A hold (`TransportClient.hold`) is for a decode worker that reads the blocks itself (GPU
  direct): once `wait` returned, the transfer stays published until `release` (which confirms
  it, as a fetch does) or until the hold breaks (`on_transfer_done(transfer_id, False)`, once
  no other hold of it is left: a decode whose connection broke may hold it again).
* A client retries a request whose connection broke, a few times, within its deadline (a
  fetch reports each layer once however many tries it took).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

KVTransferErrorKind = Literal["timeout", "connection", "not_found", "aborted", "mismatch"]
TRANSFER_ERROR_KINDS: tuple[str, ...] = get_args(KVTransferErrorKind)

TransferDoneCallback = Callable[[str, bool], None]


class KVTransferError(RuntimeError):
    """A fetch that did not deliver every layer.

    kind: "timeout" (the fetch's overall deadline passed), "connection" (could not connect, or the
    connection broke or carried something that is not the protocol), "not_found" (the server has no
    transfer under that id), "aborted" (the transfer was withdrawn, or its producer failed, during
    the fetch), "mismatch" (the destination tensors' byte sizes differ from the published ones).
    """

    def __init__(self, kind: KVTransferErrorKind, message: str) -> None:
        if kind not in TRANSFER_ERROR_KINDS:
            raise ValueError(f"unknown KV transfer error kind {kind!r}")
        super().__init__(f"{kind}: {message}")
        self.kind: KVTransferErrorKind = kind


@dataclass(frozen=True)
class TransportFault:
    """Faults a server injects into its fetches, for testing the layers above the transport.

    drop_after_layers: close the connection after sending that many layers (0: before any; the
        number of layers or more: after every layer, before the confirmation).
    delay_s: sleep this long before sending the first layer.
    times: inject into the first `times` fetches only; None injects into every fetch.
    """

    drop_after_layers: int | None = None
    delay_s: float = 0.0
    times: int | None = None

    def __post_init__(self) -> None:
        if self.drop_after_layers is not None and self.drop_after_layers < 0:
            raise ValueError("drop_after_layers must be >= 0")
        if self.delay_s < 0:
            raise ValueError("delay_s must be >= 0")
        if self.times is not None and self.times < 1:
            raise ValueError("times must be >= 1")

    @classmethod
    def parse(cls, text: str) -> TransportFault:
        """Parse comma-separated `key:value` items: `drop:N`, `delay:SECONDS`, `times:N`.

        Examples: "drop:1", "delay:5", "delay:0.5,drop:2,times:1".
        """
        fields: dict[str, float | int] = {}
        for item in text.split(","):
            key, sep, value = item.strip().partition(":")
            try:
                if not sep:
                    raise ValueError
                if key == "drop":
                    fields["drop_after_layers"] = int(value)
                elif key == "delay":
                    fields["delay_s"] = float(value)
                elif key == "times":
                    fields["times"] = int(value)
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"bad transport fault item {item.strip()!r} in {text!r}: "
                    "use drop:LAYERS, delay:SECONDS or times:FETCHES, separated by commas"
                ) from None
        return cls(**fields)


class TransportServer(ABC):
    """Prefill side: makes published per-layer tensors fetchable by decode workers."""

    @abstractmethod
    def publish(
        self,
        transfer_id: str,
        layers: Sequence[torch.Tensor],
        wait_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Make `layers` fetchable under transfer_id; layer i goes out after wait_layer(i)."""

    @abstractmethod
    def withdraw(self, transfer_id: str) -> None:
        """Forget a transfer (no-op when unknown); a fetch in progress ends with "aborted"."""

    @abstractmethod
    def announce(
        self, handoff_id: str, message: dict[str, Any], transfer_id: str | None = None
    ) -> None:
        """Give `message` to the decode worker that waits (or will wait) on handoff_id, with
        transfer_id (a published transfer the message names) held for it if it asked for a
        hold; never waits on the network."""

    @abstractmethod
    def announce_early(self, handoff_id: str, transfer_id: str, message: dict[str, Any]) -> bool:
        """Send `message` ahead of the announcement to a decode worker that waits on
        handoff_id already and takes early announcements, with transfer_id held for it, or keep
        it for one that comes to wait before the announcement; False when it was neither sent
        nor kept (the announcement then carries everything)."""

    @abstractmethod
    def announce_more(self, handoff_id: str, message: dict[str, Any]) -> bool:
        """After `announce_early`: send `message` as a further early announcement to the
        decode worker that got the early one, or add its keys to the early message kept for
        one yet to come; False when neither (it came meanwhile, or none was kept)."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and forget every transfer."""


class TransferHold(ABC):
    """A decode worker's hold on a published transfer, asked for before it reads the blocks."""

    # The hold came with an early announcement; `announcement()` brings the next one, until the
    # announcement proper.
    announcement_pending: bool = False

    @abstractmethod
    def wait(self) -> None:
        """Block until the server holds the transfer; raises KVTransferError when it cannot
        ("not_found", "aborted": the transfer ended first) or the exchange failed."""

    @abstractmethod
    def announcement(self, cancelled: threading.Event | None = None) -> dict[str, Any]:
        """After an early announcement: block until the next announcement arrives and return
        it, a further early one (`announcement_pending` stays True) or the announcement proper;
        raises KVTransferError ("aborted" once `cancelled` is set, "timeout", "connection")."""

    @abstractmethod
    def release(self) -> None:
        """Confirm the transfer and end the hold; raises KVTransferError on failure."""

    @abstractmethod
    def abandon(self) -> None:
        """Drop the hold without confirming (the server lets go of the transfer)."""


class TransportClient(ABC):
    """Decode side: pulls a published transfer into preallocated per-layer tensors."""

    @abstractmethod
    def fetch(
        self,
        host: str,
        port: int,
        transfer_id: str,
        dest_layers: Sequence[torch.Tensor],
        *,
        timeout: float,
        on_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Receive every layer, calling on_layer(i) as each arrives, then confirm; raises
        KVTransferError on failure."""

    @abstractmethod
    def release(self, host: str, port: int, transfer_id: str, *, timeout: float) -> None:
        """Confirm a transfer without fetching its bytes (the decode side needs none of them)."""

    @abstractmethod
    def hold(self, host: str, port: int, transfer_id: str, *, timeout: float) -> TransferHold:
        """Start a hold on the transfer; the caller reads the blocks, then waits for the hold
        before it uses them."""

    @abstractmethod
    def await_announcement(
        self,
        host: str,
        port: int,
        handoff_id: str,
        *,
        timeout: float,
        cancelled: threading.Event | None = None,
    ) -> dict[str, Any]:
        """Block until the server announces handoff_id and return its message; raises
        KVTransferError ("timeout", "aborted" once `cancelled` is set, "connection")."""

    @abstractmethod
    def await_held_announcement(
        self,
        host: str,
        port: int,
        handoff_id: str,
        *,
        timeout: float,
        hold_timeout: float,
        cancelled: threading.Event | None = None,
        early: bool = False,
    ) -> tuple[dict[str, Any], TransferHold | None]:
        """As await_announcement, with the transfer the announcement names held for the
        caller when the server could hold it (the hold needs no wait), else None. With `early`
        the message may be an early announcement (`hold.announcement_pending`)."""

    @abstractmethod
    def close(self) -> None:
        """Release every connection."""
