"""The decode side of the KV control plane: requests to prefill workers' KV servers.

`KVClient` fetches a transfer's layers (from a block on), releases a lease without its bytes,
holds a lease while the decode reads the blocks itself (`Hold`), and waits for a handoff's
announcement.
Connections are pooled per peer and authenticated once (`tandem.kv.control.auth`). A request
whose connection broke, could not be opened or stayed silent through the handshake is tried
again on a new one, RETRY_ATTEMPTS in all with backoff, within its deadline; a refused
handshake, the server's ERROR reply, the deadline or a cancellation is not retried. A wait
learns of a peer gone without a word from TCP keepalive (`configure_socket`), within seconds.
Every failure is a `KVTransferError`. The protocol: docs/protocol.md, "The KV port".
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from tandem.kv.control.auth import HANDSHAKE_TIMEOUT_S, derive_kv_key, open_handshake
from tandem.kv.control.hold import Broken, Hold, raise_transport_error
from tandem.kv.control.wire import (
    ANNOUNCE,
    AWAIT,
    CONFIRM,
    DONE,
    ERROR,
    FETCH,
    HEADER,
    HELD_FLAG,
    LAYER,
    AwaitRequest,
    FetchRequest,
    ProtocolError,
    announcement_decoder,
    byte_view,
    configure_socket,
    encoder,
    error_decoder,
    is_alive,
    recv_control,
    recv_exact,
    recv_header,
    recv_header_waiting,
    send_message,
)
from tandem.kv.errors import TRANSFER_ERROR_KINDS, KVTransferError

logger = logging.getLogger(__name__)

RETRY_ATTEMPTS = 3  # tries of a request whose connection broke, the first included
RETRY_BACKOFF_S = 0.05  # the pause before the first retry, doubled before each next one


class KVClient:
    """Decode side: fetches transfers from KVServers, reusing one idle connection per fetch.

    Thread-safe: concurrent fetches each take their own connection; a connection goes back to the
    idle pool (at most `max_idle_per_peer` per (host, port)) only after a fetch that ended cleanly.
    A new connection passes the handshake (`tandem.kv.control.auth`, proving cluster_token if given)
    within handshake_timeout; a request whose connection broke is tried again, retry_attempts
    in all, calling on_retry before each new try.
    """

    def __init__(
        self,
        *,
        max_idle_per_peer: int = 8,
        cluster_token: str | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        retry_attempts: int = RETRY_ATTEMPTS,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        if retry_attempts < 1:
            raise ValueError("retry_attempts must be >= 1")
        self._key = derive_kv_key(cluster_token)
        self._handshake_timeout = handshake_timeout
        self._retry_attempts = retry_attempts
        self._on_retry = on_retry
        self._max_idle_per_peer = max_idle_per_peer
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._closed = False

    def fetch(
        self,
        host: str,
        port: int,
        transfer_id: str,
        dest_layers: Sequence[torch.Tensor],
        *,
        timeout: float,
        on_layer: Callable[[int], None] | None = None,
        first_block: int = 0,
    ) -> None:
        """Receive every layer into dest_layers (contiguous CPU tensors of the published byte
        sizes; from first_block on: of the bytes of each published layer [:, first_block:]),
        calling on_layer(i) as each arrives, then confirm. When this returns, the server
        has recorded the confirmation and forgotten the transfer; its on_transfer_done(id, True)
        runs right after it sent that answer. Raises KVTransferError on timeout (overall deadline),
        connection loss, unknown id, withdrawal or a size mismatch; an exception from on_layer
        propagates as is. A fetch tried again after a break gets the layers again (the same
        bytes) and reports only those not reported before; one that broke with every layer in
        only confirms."""
        views = [byte_view(layer) for layer in dest_layers]
        num_reported = 0

        def report(index: int) -> None:
            nonlocal num_reported
            if index >= num_reported:
                num_reported = index + 1
                if on_layer is not None:
                    on_layer(index)

        def exchange(connection: socket.socket, deadline: float) -> None:
            if views and num_reported == len(views):
                self._confirm_again(connection, transfer_id, deadline)
            else:
                self._exchange(connection, transfer_id, views, deadline, report, first_block)

        self._with_connection(host, port, f"fetch of {transfer_id!r}", timeout, exchange)

    def release(self, host: str, port: int, transfer_id: str, *, timeout: float) -> None:
        """Tell the server the transfer is done without fetching it (the decode side needs none
        of its bytes); the server then calls on_transfer_done(id, True). Raises KVTransferError
        as fetch does."""
        sent = False

        def exchange(connection: socket.socket, deadline: float) -> None:
            nonlocal sent
            if sent:  # on a connection that broke: it may have arrived
                self._confirm_again(connection, transfer_id, deadline)
                return
            sent = True
            self._exchange(connection, transfer_id, [], deadline, None, release_only=True)

        self._with_connection(host, port, f"release of {transfer_id!r}", timeout, exchange)

    def _confirm_again(self, connection: socket.socket, transfer_id: str, deadline: float) -> None:
        """A confirmation (or release) whose first connection broke: release the transfer; one
        the server no longer has was confirmed then (or its lease ended): done either way."""
        try:
            self._exchange(connection, transfer_id, [], deadline, None, release_only=True)
        except KVTransferError as exc:
            if exc.kind != "not_found":
                raise

    def hold(self, host: str, port: int, transfer_id: str, *, timeout: float) -> Hold:
        """Ask the server to hold the transfer (the hold is on its way when this returns).
        Raises KVTransferError as fetch does; `timeout` bounds the hold's whole life. Until
        HELD, a connection that breaks is replaced and the hold asked for again."""
        deadline = time.monotonic() + timeout
        request = encoder.encode(FetchRequest(transfer_id, [], hold=True))
        what = f"hold of {transfer_id!r}"
        hold = Hold(self, (host, port), None, what, timeout, deadline, request=request)
        self._retrying(deadline, hold.ask)
        return hold

    def await_announcement(
        self,
        host: str,
        port: int,
        handoff_id: str,
        *,
        timeout: float,
        cancelled: threading.Event | None = None,
        engine_id: str | None = None,
    ) -> dict[str, Any]:
        """Wait until the server's side announces handoff_id and return what it announced.
        Raises KVTransferError: "timeout" when nothing came within `timeout`, "aborted" once
        `cancelled` is set (checked every AWAIT_POLL_S), "not_found" at once from a server
        that is not `engine_id`'s (one restarted on its address, after a broken wait: what
        would have been announced died with the engine), and as fetch does otherwise."""

        def exchange(connection: socket.socket, deadline: float) -> dict[str, Any]:
            message, _ = self._await(connection, deadline, handoff_id, cancelled, engine_id)
            return message

        return self._with_connection(host, port, f"wait for {handoff_id!r}", timeout, exchange)

    def await_held_announcement(
        self,
        host: str,
        port: int,
        handoff_id: str,
        *,
        timeout: float,
        hold_timeout: float,
        cancelled: threading.Event | None = None,
        engine_id: str | None = None,
    ) -> tuple[dict[str, Any], Hold | None]:
        """As await_announcement, asking the server to hold the transfer the announcement names
        for this connection. Returns the announcement and the hold when the server holds it
        (already held: no wait; `hold_timeout` bounds the rest of its life), else None."""

        def exchange(
            connection: socket.socket, deadline: float
        ) -> tuple[dict[str, Any], Hold | None]:
            message, flags = self._await(
                connection, deadline, handoff_id, cancelled, engine_id, hold=True
            )
            if not flags & HELD_FLAG:
                return message, None
            hold_deadline = time.monotonic() + hold_timeout
            peer = (host, port)
            what = f"hold of the transfer announced for {handoff_id!r}"
            hold = Hold(self, peer, connection, what, hold_timeout, hold_deadline, held=True)
            return message, hold

        return self._with_connection(
            host,
            port,
            f"wait for {handoff_id!r}",
            timeout,
            exchange,
            keeps_connection=lambda result: result[1] is not None,
        )

    def _await(
        self,
        connection: socket.socket,
        deadline: float,
        handoff_id: str,
        cancelled: threading.Event | None,
        engine_id: str | None,
        hold: bool = False,
    ) -> tuple[dict[str, Any], int]:
        """One AWAIT (until the deadline): the announcement, and its flags (HELD_FLAG: its
        transfer is held for this connection)."""
        timeout = max(deadline - time.monotonic(), 0.0)
        request = encoder.encode(AwaitRequest(handoff_id, timeout, hold, engine_id))
        connection.settimeout(max(deadline - time.monotonic(), 1e-3))
        send_message(connection, AWAIT, request)
        header = bytearray(HEADER.size)
        message_type, flags, length = recv_header_waiting(connection, header, deadline, cancelled)
        if message_type == ERROR:
            self._raise_error_reply(connection, length, deadline)
        allowed = {0, HELD_FLAG} if hold else {0}
        if message_type != ANNOUNCE or flags not in allowed:
            raise ProtocolError(f"expected ANNOUNCE, got message type {message_type} ({flags})")
        message = announcement_decoder.decode(recv_control(connection, length, deadline))
        return message, flags

    def _with_connection(
        self,
        host: str,
        port: int,
        what: str,
        timeout: float,
        exchange: Callable[[socket.socket, float], Any],
        keeps_connection: Callable[[Any], bool] | None = None,
    ) -> Any:
        """Run exchange(connection, deadline) on a pooled connection to the peer. A connection
        whose exchange ended with the server's ERROR reply (a KVTransferError) stays usable;
        one that broke is closed and the exchange tried again on another (`_retrying`); the
        last failure, or a timeout, is raised as a KVTransferError. A result for which
        keeps_connection is true owns the connection (it is not pooled)."""
        deadline = time.monotonic() + timeout
        peer = (host, port)

        def attempt() -> Any:
            connection = self._checkout(peer, deadline)
            try:
                result = exchange(connection, deadline)
            except KVTransferError:
                self._checkin(peer, connection)
                raise
            except BaseException as exc:
                connection.close()  # mid-exchange: nothing else may use it
                raise_transport_error(exc, what, peer, timeout, retryable=True)
            if keeps_connection is None or not keeps_connection(result):
                self._checkin(peer, connection)
            return result

        return self._retrying(deadline, attempt)

    def _retrying(self, deadline: float, attempt: Callable[[], Any]) -> Any:
        """attempt() again, after a pause, each time it raises Broken: retry_attempts tries in
        all, while the pause ends before the deadline; then the last failure is raised."""
        pause = RETRY_BACKOFF_S
        for number in range(1, self._retry_attempts + 1):
            try:
                return attempt()
            except Broken as broken:
                if number == self._retry_attempts or time.monotonic() + pause >= deadline:
                    raise broken.error from broken.__cause__
                logger.warning(
                    "KV %s; trying again on a new connection (try %d of %d)",
                    broken.error,
                    number + 1,
                    self._retry_attempts,
                )
                if self._on_retry is not None:
                    self._on_retry()
                time.sleep(pause)
                pause *= 2
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close every idle connection; later fetches are refused."""
        with self._lock:
            self._closed = True
            idle = [connection for pool in self._idle.values() for connection in pool]
            self._idle.clear()
        for connection in idle:
            connection.close()

    def _exchange(
        self,
        connection: socket.socket,
        transfer_id: str,
        views: list[memoryview],
        deadline: float,
        on_layer: Callable[[int], None] | None,
        first_block: int = 0,
        release_only: bool = False,
    ) -> None:
        """Run one fetch on the connection until DONE; the server's ERROR reply is raised as a
        KVTransferError."""
        nbytes = [len(view) for view in views]
        request = encoder.encode(
            FetchRequest(transfer_id, nbytes, release_only, first_block=first_block)
        )
        connection.settimeout(max(deadline - time.monotonic(), 1e-3))
        send_message(connection, FETCH, request)
        header = bytearray(HEADER.size)
        if release_only:
            self._await_done(connection, header, deadline)
            return
        for index, view in enumerate(views):
            message_type, layer, length = self._recv_reply(connection, header, deadline)
            if message_type == ERROR:
                self._raise_error_reply(connection, length, deadline)
            if message_type != LAYER or layer != index or length != len(view):
                raise ProtocolError(
                    f"expected layer {index} of {len(view)} bytes, got message type "
                    f"{message_type} layer {layer} of {length} bytes"
                )
            recv_exact(connection, view, deadline)
            if on_layer is not None:
                on_layer(index)
        connection.settimeout(max(deadline - time.monotonic(), 1e-3))
        send_message(connection, CONFIRM)
        self._await_done(connection, header, deadline)

    def _await_done(self, connection: socket.socket, header: bytearray, deadline: float) -> None:
        message_type, _, length = self._recv_reply(connection, header, deadline)
        if message_type == ERROR:
            self._raise_error_reply(connection, length, deadline)
        if message_type != DONE or length != 0:
            raise ProtocolError(f"expected DONE, got message type {message_type}")

    @staticmethod
    def _recv_reply(
        connection: socket.socket, header: bytearray, deadline: float
    ) -> tuple[int, int, int]:
        message = recv_header(connection, header, deadline)
        if message is None:
            raise ProtocolError("the server closed the connection")
        return message

    @staticmethod
    def _raise_error_reply(connection: socket.socket, length: int, deadline: float) -> NoReturn:
        """Read the server's ERROR reply and raise it (the connection stays usable)."""
        error = error_decoder.decode(recv_control(connection, length, deadline))
        if error.kind not in TRANSFER_ERROR_KINDS:
            raise ProtocolError(f"unknown error kind {error.kind!r}")
        raise KVTransferError(error.kind, error.message)  # type: ignore[arg-type]

    def _checkout(self, peer: tuple[str, int], deadline: float) -> socket.socket:
        """An idle live connection to the peer, or a new one (raises as `_connect`)."""
        while True:
            with self._lock:
                if self._closed:
                    raise KVTransferError("connection", "the KV client is closed")
                pool = self._idle.get(peer)
                connection = pool.pop() if pool else None
            if connection is None:
                return self._connect(peer, deadline)
            if is_alive(connection):
                return connection
            connection.close()

    def _checkin(self, peer: tuple[str, int], connection: socket.socket) -> None:
        with self._lock:
            pool = self._idle.setdefault(peer, [])
            if not self._closed and len(pool) < self._max_idle_per_peer:
                pool.append(connection)
                return
        connection.close()

    def _connect(self, peer: tuple[str, int], deadline: float) -> socket.socket:
        """A new connection that passed the handshake; the connect and the handshake each take
        the handshake timeout at most. Raises Broken when it could not be opened, broke or
        stayed silent (a reply lost on the way reads as a silent peer, and nothing was asked on
        it yet); KVTransferError for the rest (a peer that is no KV server, or refuses us)."""
        host, port = peer
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )[0]
            connection = socket.socket(family, kind, proto)
        except OSError as exc:
            raise KVTransferError("connection", f"cannot resolve {host}:{port}: {exc}") from exc
        try:
            configure_socket(connection)
            connect_deadline = min(deadline, time.monotonic() + self._handshake_timeout)
            connection.settimeout(max(connect_deadline - time.monotonic(), 1e-3))
            connection.connect(address)
            handshake_deadline = min(deadline, time.monotonic() + self._handshake_timeout)
            open_handshake(connection, self._key, peer, handshake_deadline)
        except KVTransferError as exc:
            connection.close()
            if exc.kind == "timeout":
                raise Broken(exc) from exc
            raise
        except TimeoutError as exc:
            connection.close()
            error = KVTransferError("timeout", f"connecting to {host}:{port} timed out")
            raise Broken(error) from exc
        except OSError as exc:
            connection.close()
            error = KVTransferError("connection", f"cannot connect to {host}:{port}: {exc}")
            raise Broken(error) from exc
        return connection
