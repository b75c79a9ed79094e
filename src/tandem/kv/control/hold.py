"""A decode worker's hold on a prefill's lease, and how a broken exchange is reported.

A hold keeps a published transfer on the prefill side until the decode confirms it, while the
decode reads the blocks another way (cuda-ipc): FETCH (hold) then HELD, or an announcement that
came with it held, then CONFIRM. Until held, a connection that broke is replaced and the hold
asked for again. `Broken` marks a failure worth another try on a new connection (the client's
retry loop catches it); every other failure is a `KVTransferError`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import msgspec

from tandem.kv.control.wire import (
    CONFIRM,
    ERROR,
    FETCH,
    HEADER,
    HELD,
    Cancelled,
    ProtocolError,
    confirm_layer,
    send_message,
)
from tandem.kv.errors import KVTransferError

if TYPE_CHECKING:
    from tandem.kv.control.client import KVClient


class Broken(Exception):
    """Client side: a request's connection broke, or could not be opened; worth another try."""

    def __init__(self, error: KVTransferError) -> None:
        super().__init__(str(error))
        self.error = error


class Hold:
    """A hold on one pooled connection: FETCH (hold) sent, then HELD awaited, then CONFIRM; or
    one an announcement came with (held already: nothing to wait for), then CONFIRM. Until
    HELD, a connection that broke is replaced and the hold asked for again."""

    def __init__(
        self,
        client: KVClient,
        peer: tuple[str, int],
        connection: socket.socket | None,
        what: str,
        timeout: float,
        deadline: float,
        *,
        request: bytes = b"",
        held: bool = False,
    ) -> None:
        self._client = client
        self._peer = peer
        self._connection = connection
        self._what = what
        self._timeout = timeout
        self._deadline = deadline
        self._request = request  # the FETCH (hold) payload, sent again after a break
        self._header = bytearray(HEADER.size)
        self._held = held

    def ask(self) -> None:
        """Send the FETCH (hold), on a new connection when there is none (the last broke)."""
        if self._connection is None:
            self._connection = self._client._checkout(self._peer, self._deadline)
        request = self._request
        self.step(lambda c: send_message(c, FETCH, request), last=False, retryable=True)

    def wait(self) -> None:
        if self._held:
            return

        def expect_held(connection: socket.socket) -> None:
            message_type, _, length = self._client._recv_reply(
                connection, self._header, self._deadline
            )
            if message_type == ERROR:
                self._client._raise_error_reply(connection, length, self._deadline)
            if message_type != HELD or length != 0:
                raise ProtocolError(f"expected HELD, got message type {message_type}")

        def attempt() -> None:
            if self._connection is None:  # the connection the hold went out on broke
                self.ask()
            self.step(expect_held, last=False, retryable=True)

        self._ensure_open()
        self._client._retrying(self._deadline, attempt)
        self._held = True

    def _ensure_open(self) -> None:
        """Before a retried part: a hold given up (or ended) is not taken up again."""
        if self._connection is None:
            raise KVTransferError("aborted", f"{self._what} has ended")

    def release(self, blocks_read: int | None = None) -> None:
        """Confirm: the prefill may free the blocks. blocks_read (the blocks of each layer this
        side read, none for a load it did not need) goes to the prefill's byte count; without
        it the whole transfer counts as read."""

        def confirm(connection: socket.socket) -> None:
            send_message(connection, CONFIRM, layer=confirm_layer(blocks_read))
            self._client._await_done(connection, self._header, self._deadline)

        self.step(confirm, last=True)

    def abandon(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def step(
        self, exchange: Callable[[socket.socket], None], *, last: bool, retryable: bool = False
    ) -> None:
        """Run one part of the hold's exchange; the connection goes back to the pool after the
        last part, or after the server's ERROR reply; it is closed when it broke (raising
        Broken for a retry if `retryable`)."""
        connection = self._connection
        if connection is None:
            raise KVTransferError("aborted", f"{self._what} has ended")
        try:
            connection.settimeout(max(self._deadline - time.monotonic(), 1e-3))
            exchange(connection)
        except KVTransferError:
            self._connection = None
            self._client._checkin(self._peer, connection)
            raise
        except BaseException as exc:
            self.abandon()
            raise_transport_error(exc, self._what, self._peer, self._timeout, retryable)
        if last:
            self._connection = None
            self._client._checkin(self._peer, connection)


def as_transfer_error(
    exc: BaseException, what: str, peer: tuple[str, int], timeout: float
) -> KVTransferError | None:
    """The KVTransferError a broken exchange reports, or None for errors that are not the
    transport's."""
    host, port = peer
    if isinstance(exc, Cancelled):
        return KVTransferError("aborted", f"{what} was cancelled")
    if isinstance(exc, TimeoutError):
        return KVTransferError("timeout", f"{what} from {host}:{port} passed {timeout} s")
    if isinstance(exc, (OSError, ProtocolError, msgspec.DecodeError)):
        return KVTransferError("connection", f"{what} from {host}:{port} broke: {exc!r}")
    return None


def raise_transport_error(
    exc: BaseException, what: str, peer: tuple[str, int], timeout: float, retryable: bool
) -> NoReturn:
    """Raise what a broken exchange reports: Broken for a connection that broke when
    `retryable`, else the KVTransferError of `as_transfer_error`; `exc` if not the transport's."""
    error = as_transfer_error(exc, what, peer, timeout)
    if error is None:
        raise exc
    if retryable and error.kind == "connection":
        raise Broken(error) from exc
    raise error from exc
