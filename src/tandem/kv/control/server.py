"""The prefill side of the KV control plane: one TCP server per engine that serves KV.

It keeps the published transfers (a transfer: the layers a decode fetches, or none when the
decode reads the blocks itself), the handoffs' rendezvous (AWAIT / ANNOUNCE) and the holds,
and streams a fetch's layers, from the block it asks for, as each becomes valid. Invariants:
`publish`, `withdraw` and `announce` never wait on the network (the engine loop calls them);
a transfer is reported done once (`on_transfer_done(id, True)`, after the decode's CONFIRM,
right after `on_transfer_served` said what the decode got of it), a broken fetch or hold as
`on_transfer_done(id, False)` while it stays published; anything unexpected from a client ends
that connection only. The protocol: docs/protocol.md, "The KV port".

Threads: one accept thread plus one per connection; `wait_layer` and the callbacks run on the
connection's thread, outside the server's lock (so they may call publish/withdraw).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
import torch

from tandem.kv.control.auth import (
    HANDSHAKE_TIMEOUT_S,
    HandshakeError,
    HandshakeRefused,
    derive_kv_key,
    serve_handshake,
)
from tandem.kv.control.records import Handoff, Transfer
from tandem.kv.control.wire import (
    ANNOUNCE,
    AWAIT,
    AWAIT_POLL_S,
    CONFIRM,
    DONE,
    FETCH,
    HEADER,
    HELD,
    HELD_FLAG,
    LAYER,
    MAGIC,
    AwaitRequest,
    FetchRequest,
    ProtocolError,
    await_decoder,
    block_shape,
    blocks_read,
    byte_view,
    configure_socket,
    encoder,
    fetch_decoder,
    fetched_parts,
    fetched_size,
    is_alive,
    recv_control,
    recv_header,
    send_error,
    send_message,
)

logger = logging.getLogger(__name__)

TransferDoneCallback = Callable[[str, bool], None]
TransferServedCallback = Callable[[str, int | None, int | None], None]


class KVServer:
    """Prefill side: serves published transfers to decode workers over TCP.

    io_timeout bounds each wait on a client during a fetch: the send of one layer (so a layer
    must move at no less than its size / io_timeout) and the wait for CONFIRM. idle_timeout closes
    connections that carry no request for that long. With a cluster_token, only clients that
    prove it are served (`tandem.kv.control.auth`); handshake_timeout bounds a new client's
    handshake. on_transfer_served(id, bytes, blocks): what the confirming client got (its
    fetch's bytes, the blocks of each layer it got or read in place; None: not known)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        on_transfer_done: TransferDoneCallback | None = None,
        on_transfer_held: Callable[[str], bool] | None = None,
        on_transfer_served: TransferServedCallback | None = None,
        io_timeout: float = 30.0,
        idle_timeout: float = 300.0,
        announcement_ttl: float = 60.0,
        cluster_token: str | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        engine_id: str | None = None,
    ) -> None:
        self._key, self._engine_id = derive_kv_key(cluster_token), engine_id
        self._handshake_timeout = handshake_timeout
        self._on_transfer_done = on_transfer_done
        self._on_transfer_held = on_transfer_held
        self._on_transfer_served = on_transfer_served or (lambda *served: None)
        self._announcement_ttl = announcement_ttl
        self._handoffs: dict[str, Handoff] = {}
        self._expiries: deque[tuple[float, str]] = deque()  # (expires, handoff id), in order
        self._io_timeout = io_timeout
        self._idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._transfers: dict[str, Transfer] = {}
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._connections_accepted = 0
        self._closing = threading.Event()

        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            configure_socket(self._listener)
            self._listener.bind(address)
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-tcp-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()

    @property
    def connections_accepted(self) -> int:
        """How many client connections this server has accepted so far."""
        return self._connections_accepted

    def publish(
        self,
        transfer_id: str,
        layers: Sequence[torch.Tensor],
        wait_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Make `layers` (contiguous CPU tensors, any dtype) fetchable under transfer_id; a fetch
        may start at a block of layers [parts, blocks, ...] (the tcp plane's [2, blocks, ...]).

        wait_layer(i) blocks until layer i's bytes are valid; layer i is sent only after it
        returns. The tensors must stay untouched until the transfer is done or withdrawn."""
        views = [byte_view(layer) for layer in layers]
        transfer = Transfer(views, [block_shape(layer) for layer in layers], wait_layer)
        with self._lock:
            if self._closing.is_set():
                raise RuntimeError("the KV server is closed")
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already published")
            self._transfers[transfer_id] = transfer

    def withdraw(self, transfer_id: str) -> None:
        """Forget the transfer (no-op when unknown); a fetch in progress ends with "aborted"."""
        with self._lock:
            transfer = self._transfers.pop(transfer_id, None)
        if transfer is not None:
            transfer.withdrawn.set()

    def announce(
        self, handoff_id: str, message: dict[str, Any], transfer_id: str | None = None
    ) -> None:
        """Hand `message` to the decode worker waiting on handoff_id (now, or when it asks),
        with `transfer_id` held for it if it asked for a hold. A decode worker that waits
        already gets it from this thread: handing the send to the connection's thread would add
        that thread's wake-up to the handoff."""
        now = time.monotonic()
        with self._lock:
            self._drop_expired(now)
            handoff = self._handoffs.setdefault(handoff_id, Handoff())
            handoff.message = message
            handoff.transfer_id = transfer_id
            self._expire(handoff_id, handoff, now)
            waiter = None if handoff.answered else handoff.waiter
            handoff.answered = handoff.answered or waiter is not None
        if waiter is not None:
            try:
                self._send_announcement(waiter, handoff)
            except OSError as exc:  # the connection's thread answers, or sees the client gone
                logger.debug(
                    "KV server on port %d: announcing %r failed: %r", self.port, handoff_id, exc
                )
                if handoff.held:  # the connection's thread holds it again if it answers
                    self._let_go(handoff.transfer_id)
                with self._lock:
                    handoff.held = False
                    handoff.answered = False
        handoff.arrived.set()

    def _expire(self, handoff_id: str, handoff: Handoff, now: float) -> None:
        """What the handoff holds is dropped `announcement_ttl` from now (under the lock)."""
        handoff.expires = now + self._announcement_ttl
        self._expiries.append((handoff.expires, handoff_id))

    def _drop_expired(self, now: float) -> None:
        """Forget the handoffs past their expiry that no wait uses (under the lock)."""
        while self._expiries and self._expiries[0][0] < now:
            _, handoff_id = self._expiries.popleft()
            handoff = self._handoffs.get(handoff_id)
            if handoff is not None and handoff.expires < now and handoff.waiter is None:
                del self._handoffs[handoff_id]

    def close(self) -> None:
        """Stop accepting, forget every transfer, end every connection and join the threads."""
        with self._lock:
            self._closing.set()
            transfers = list(self._transfers.values())
            self._transfers.clear()
            connections = dict(self._connections)
        for transfer in transfers:
            transfer.withdrawn.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._accept_thread.join(timeout=5.0)
        for thread in connections.values():
            thread.join(timeout=5.0)

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                connection, address = self._listener.accept()
            except OSError:
                if self._closing.is_set():
                    return
                logger.warning("KV server on port %d: accept failed", self.port, exc_info=True)
                self._closing.wait(0.05)
                continue
            thread = threading.Thread(
                target=self._serve_connection,
                args=(connection, address),
                name=f"kv-tcp-conn-{self.port}",
                daemon=True,
            )
            with self._lock:
                if self._closing.is_set():
                    connection.close()
                    return
                self._connections[connection] = thread
                self._connections_accepted += 1
            thread.start()

    def _serve_connection(self, connection: socket.socket, address: Any) -> None:
        header = bytearray(HEADER.size)
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            serve_handshake(connection, self._key, self._handshake_timeout)
            while not self._closing.is_set():
                connection.settimeout(self._idle_timeout)
                message = recv_header(connection, header)
                if message is None:
                    return
                message_type, _, length = message
                if message_type not in (FETCH, AWAIT):
                    raise ProtocolError(f"expected FETCH or AWAIT, got type {message_type}")
                connection.settimeout(self._io_timeout)
                payload = recv_control(connection, length)
                if message_type == AWAIT:
                    self._serve_await(connection, await_decoder.decode(payload), header)
                else:
                    self._serve_fetch(connection, fetch_decoder.decode(payload), header)
        except HandshakeRefused as exc:
            client = f"{address[0]}:{address[1]}"
            logger.warning(
                "KV server on port %d refused a client at %s: %s", self.port, client, exc
            )
        except (OSError, HandshakeError, ProtocolError, msgspec.DecodeError) as exc:
            logger.debug("KV server on port %d: connection ended: %r", self.port, exc)
        except Exception:
            logger.exception("KV server on port %d: connection handler failed", self.port)
        finally:
            with self._lock:
                self._connections.pop(connection, None)
            connection.close()

    def _serve_await(
        self, connection: socket.socket, request: AwaitRequest, header: bytearray
    ) -> None:
        """Answer one AWAIT once its handoff is announced, or with a timeout error; an
        announcement that went out with its transfer held then waits for CONFIRM. Raises when
        the client leaves while waiting (the connection then closes). A wait for another engine
        (begun on one gone from this address: a worker restarted) is "not_found" at once."""
        if request.engine_id not in (None, self._engine_id):
            return send_error(connection, "not_found", f"engine {request.engine_id} is gone")
        handoff_id = request.handoff_id
        with self._lock:
            handoff = self._handoffs.get(handoff_id)
            if handoff is None or handoff.waiter is not None or handoff.answered:
                handoff = self._handoffs[handoff_id] = Handoff.renewed(handoff)
            handoff.waiter = connection  # an announcement from now on is sent by `announce`
            handoff.hold_wanted = request.hold
        deadline = time.monotonic() + request.timeout_s
        try:
            while not handoff.arrived.wait(AWAIT_POLL_S):
                # `answered` is read after the liveness check: `announce` marks it before it
                # sends, so a client already talking about its next request is answered, not gone.
                gone = not is_alive(connection) and not handoff.answered
                if self._closing.is_set() or gone:
                    raise ProtocolError(f"the client stopped waiting for {handoff_id!r}")
                if time.monotonic() > deadline or handoff.answered:
                    break
        finally:
            connection.settimeout(self._io_timeout)
            with self._lock:
                self._forget_wait(handoff_id, handoff)
                answer_here = not handoff.answered
                handoff.answered = True
        if answer_here and handoff.message is None:
            send_error(connection, "timeout", f"nothing was announced for {handoff_id!r} in time")
            return
        try:
            if answer_here:
                self._send_announcement(connection, handoff)
            else:  # `announce` sends it; whether it holds the transfer is known once it is done
                handoff.arrived.wait(self._io_timeout)
        except BaseException:
            if handoff.held:
                self._let_go(handoff.transfer_id)
            raise
        if handoff.held:
            self._serve_held(connection, handoff.transfer_id, header)

    def _forget_wait(self, handoff_id: str, handoff: Handoff) -> None:
        """The wait on `handoff` is over (called under the lock): it has no waiter to send to;
        with nothing announced it is no longer listed (a later AWAIT for its id starts afresh),
        else it stays until it expires (a later AWAIT gets the announcement again)."""
        if self._handoffs.get(handoff_id) is handoff and handoff.message is None:
            del self._handoffs[handoff_id]
        handoff.waiter = None

    def _serve_held(self, connection: socket.socket, transfer_id: str, header: bytearray) -> None:
        """After an announcement that went out with its transfer held: wait for CONFIRM."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
        if transfer is None:  # a held transfer stays published until the server closes
            raise ProtocolError(f"held transfer {transfer_id!r} is gone")
        self._serve_hold(connection, transfer_id, transfer, header)

    def _send_announcement(self, connection: socket.socket, handoff: Handoff) -> None:
        """Send the handoff's announcement, holding its transfer first if the waiter asked."""
        if handoff.hold_wanted and handoff.transfer_id is not None and not handoff.held:
            with self._lock:
                transfer = self._transfers.get(handoff.transfer_id)
            if transfer is not None and not transfer.layers:  # as FETCH (hold): no layers
                handoff.held = self._hold(handoff.transfer_id)
        payload = encoder.encode(handoff.message)
        send_message(connection, ANNOUNCE, payload, layer=HELD_FLAG if handoff.held else 0)

    def _serve_fetch(
        self, connection: socket.socket, request: FetchRequest, header: bytearray
    ) -> None:
        """Serve one fetch. Returns with the connection ready for the next request; raises (after
        reporting a broken fetch) when the connection must close."""
        transfer_id = request.transfer_id
        with self._lock:
            transfer = self._transfers.get(transfer_id)
        if transfer is None:
            send_error(connection, "not_found", f"no published transfer {transfer_id!r}")
            return
        if request.release_only:
            transfer.served = (0, 0)
            self._finish(connection, transfer_id, transfer)
            return
        try:
            sent = fetched_parts(transfer.layers, transfer.block_shapes, request)
        except ValueError as exc:
            self._report_done(transfer_id, transfer, False)
            send_error(connection, "mismatch", f"transfer {transfer_id!r} {exc}")
            return
        if request.hold:
            if not self._hold(transfer_id):
                send_error(connection, "aborted", f"transfer {transfer_id!r} has ended")
                return
            send_message(connection, HELD)
            self._serve_hold(connection, transfer_id, transfer, header)
            return
        try:
            outcome = self._stream_layers(connection, transfer_id, transfer, sent, header)
        except BaseException:
            self._report_done(transfer_id, transfer, False)
            raise
        if outcome == "confirmed":
            transfer.served = fetched_size(sent, transfer.block_shapes, request.first_block)
            self._finish(connection, transfer_id, transfer)
        elif outcome == "failed":
            self._report_done(transfer_id, transfer, False)

    def _stream_layers(
        self,
        connection: socket.socket,
        transfer_id: str,
        transfer: Transfer,
        sent: list[list[memoryview]],
        header: bytearray,
    ) -> Literal["confirmed", "withdrawn", "failed"]:
        """Send every layer (`sent`: the parts of each that the fetch gets), then wait for
        CONFIRM. Raises when the connection must close."""
        for index, parts in enumerate(sent):
            if transfer.wait_layer is not None:
                try:
                    transfer.wait_layer(index)
                except Exception as exc:
                    logger.exception("wait_layer(%d) of transfer %r failed", index, transfer_id)
                    send_error(connection, "aborted", f"layer {index} failed: {exc!r}")
                    return "failed"
            if transfer.withdrawn.is_set():
                send_error(connection, "aborted", f"transfer {transfer_id!r} was withdrawn")
                return "withdrawn"
            self._send_layer(connection, index, parts)
        message = recv_header(connection, header)
        if message is None or message[0] != CONFIRM or message[2] != 0:
            raise ProtocolError(f"expected CONFIRM, got {message}")
        return "confirmed"

    @staticmethod
    def _send_layer(connection: socket.socket, index: int, parts: list[memoryview]) -> None:
        connection.sendall(HEADER.pack(MAGIC, LAYER, index, sum(len(part) for part in parts)))
        for part in parts:
            connection.sendall(part)

    def _serve_hold(
        self, connection: socket.socket, transfer_id: str, transfer: Transfer, header: bytearray
    ) -> None:
        """A held transfer: wait for the client's CONFIRM, then answer DONE. Lets go of the
        transfer (on_transfer_done(id, False)) and raises when the connection must close."""
        try:
            message = recv_header(connection, header)
            if message is None or message[0] != CONFIRM or message[2] != 0:
                raise ProtocolError(f"expected CONFIRM, got {message}")
        except BaseException:
            self._let_go(transfer_id)
            raise
        transfer.served = (None, blocks_read(message[1]))
        self._finish(connection, transfer_id, transfer)

    def _finish(self, connection: socket.socket, transfer_id: str, transfer: Transfer) -> None:
        with self._lock:
            completed = self._transfers.get(transfer_id) is transfer
            if completed:
                del self._transfers[transfer_id]
        if not completed:
            send_error(connection, "aborted", f"transfer {transfer_id!r} was withdrawn")
            return
        try:
            self._on_transfer_served(transfer_id, *transfer.served)
        except Exception:
            logger.exception("on_transfer_served(%r) failed", transfer_id)
        try:
            send_message(connection, DONE)
        finally:
            self._call_done(transfer_id, True)

    def _let_go(self, transfer_id: str) -> None:
        """A hold ends without CONFIRM: on_transfer_done(id, False) if still published and held
        by no other connection (its client may have held it again on a new one)."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is not None:
                transfer.holds = max(transfer.holds - 1, 0)
            last = transfer is not None and transfer.holds == 0
        if last:
            self._call_done(transfer_id, False)

    def _hold(self, transfer_id: str) -> bool:
        if self._on_transfer_held is not None:
            try:
                if not self._on_transfer_held(transfer_id):
                    return False
            except Exception:
                logger.exception("on_transfer_held(%r) failed", transfer_id)
                return False
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is not None:
                transfer.holds += 1
        return True

    def _report_done(self, transfer_id: str, transfer: Transfer, ok: bool) -> None:
        with self._lock:
            published = self._transfers.get(transfer_id) is transfer
        if published:
            self._call_done(transfer_id, ok)

    def _call_done(self, transfer_id: str, ok: bool) -> None:
        if self._on_transfer_done is None:
            return
        try:
            self._on_transfer_done(transfer_id, ok)
        except Exception:
            logger.exception("on_transfer_done(%r, %s) failed", transfer_id, ok)
