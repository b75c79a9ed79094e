"""TCP KV transport: decode workers pull per-layer staging tensors from a prefill worker's server.

The prefill side publishes, per transfer, one contiguous CPU tensor per layer (pinned on CUDA
hosts); the decode side receives each layer straight into a preallocated contiguous CPU tensor.
Bytes go between socket and tensor memory through uint8 views (`sendall` / `recv_into`): no
per-block Python objects, no intermediate copies. This module moves bytes only; see
`tandem.kv.transport` for the contract shared by all transports.

Wire format. A new connection starts with the handshake of `tandem.kv.auth` (the server speaks
first; with a cluster token both sides prove it); then it carries any number of fetches, one
after another; every message is a 20-byte header, then `length` payload bytes:

    header = magic b"TKV1" | type u8 | 3 pad bytes | layer u32 | length u64     (big-endian)

    client -> server  FETCH    msgpack {"transfer_id": str, "layer_nbytes": [int, ...],
                                        "release_only": bool, "hold": bool}; release_only skips
                               to DONE; hold (no layers) asks the server to keep the transfer
                               as published until CONFIRM, while the client reads it another way
    server -> client  HELD     empty: the transfer is held (the answer to a hold, before CONFIRM)
    server -> client  LAYER    layer = i, payload = layer i's raw bytes (each layer once, in order)
    client -> server  CONFIRM  empty: every layer arrived
    server -> client  DONE     empty: the confirmation is recorded (the transfer is forgotten)
    server -> client  ERROR    msgpack {"kind": str, "message": str}: the fetch ended; the
                               connection stays usable

    client -> server  AWAIT    msgpack {"handoff_id": str, "timeout_s": float, "hold": bool,
                               "early": bool}: wait until the prefill side announces that
                               handoff (see below); hold asks for the announced transfer held for
                               this connection, early (with hold) takes an early announcement
    server -> client  ANNOUNCE msgpack map: what the prefill side announced; layer holds flags:
                               1 when the transfer it names is held for this connection (as after
                               HELD), 2 when it is early (more follow: early ones, flags 2, then
                               the announcement proper, flags 0)

    FETCH ─▶ ◀─ LAYER 0 ◀─ LAYER 1 … ◀─ LAYER n-1   CONFIRM ─▶ ◀─ DONE
         └─▶ ◀─ ERROR (not_found / mismatch / aborted), at the start or between layers
    FETCH (hold) ─▶ ◀─ HELD  … the client reads the blocks itself …  CONFIRM ─▶ ◀─ DONE
    AWAIT ─▶ … ◀─ ANNOUNCE        or ◀─ ERROR (timeout) once timeout_s passed unannounced
    AWAIT (hold) ─▶ … ◀─ ANNOUNCE (layer 1)  … the client reads the blocks …  CONFIRM ─▶ ◀─ DONE
    AWAIT (hold, early) ─▶ … ◀─ ANNOUNCE (layer 3) [◀─ ANNOUNCE (layer 2) …] … ◀─ ANNOUNCE
                        (layer 0) … CONFIRM ─▶ ◀─ DONE

Handoffs let a decode worker wait for a prefill that has not finished (or not even arrived) yet:
the prefill side calls `announce(handoff_id, message)` once it knows what the decode needs (its
transfer parameters, or that there is nothing to load); a waiting AWAIT gets it at once, a later
one finds it waiting. An announcement is kept for `announcement_ttl`, claimed or not: an AWAIT
that comes again (its connection broke) gets it again, with the transfer held anew if it asks.

A hold is how GPU-direct transports keep their guarantee without a round trip after the copy: the
client sends the hold, copies while it travels, and uses the copy only once HELD came back. The
transfer was published (its lease alive) when the server held it, so it was during the copy
too, and it stays so until CONFIRM; the server asks its owner first (`on_transfer_held`, which
may refuse: the lease already ended), and a connection that closes before CONFIRM lets go of it
(on_transfer_done(id, False), once no other connection holds it).

A handoff's announcement can carry the hold itself: a decode worker that waits with AWAIT (hold)
gets the transfer the announcement names held as the announcement goes out (`announce(...,
transfer_id)`; the owner is asked as for a hold), so it copies as soon as the announcement
arrives, with no round trip before it may use the copy. An ANNOUNCE with layer 0 holds nothing
(nothing to hold, the owner refused, or no hold was asked for): the client holds as above.

An early announcement goes out before the prefill is done (`announce_early`): as soon as the
prefill's KV is queued on its GPU, a decode worker that waits with AWAIT (hold, early) gets what
it needs to queue its copy behind that work, with the transfer held; the announcement proper
(the first token, or why the prefill gave up) follows on the same connection when `announce` is
called, and only then may the client use the copy. One whose AWAIT (hold, early) arrives later,
but before the announcement proper, gets the early announcement then, from its connection's
thread. A waiter that did not ask for it, or one that comes after the announcement proper,
gets only the announcement proper. Between the two, `announce_more` sends further early
announcements (what the prefill has queued since) to a waiter that got the early one, or adds
them to the early message kept for one yet to come.

Threads: the server runs one accept thread plus one thread per connection; `wait_layer` and the
`on_transfer_done` and `on_transfer_held` callbacks run on the connection's thread (the callbacks
outside the server's lock, so they may call publish/withdraw). Anything unexpected from a client
(garbage, a drop, silence past `io_timeout`) ends that connection only; a fetch that breaks that
way reports on_transfer_done(id, False) if the transfer is still published, and leaves it
published. The client retries a request whose connection broke (or could not be opened) on a
new connection, RETRY_ATTEMPTS in all, with backoff, within the request's deadline; a failed
handshake, the server's ERROR reply, a timeout or a cancellation is not retried.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import msgspec
import torch

from tandem.kv.auth import (
    HANDSHAKE_TIMEOUT_S,
    HandshakeError,
    HandshakeRefused,
    derive_kv_key,
    open_handshake,
    serve_handshake,
)
from tandem.kv.transport import (
    TRANSFER_ERROR_KINDS,
    KVTransferError,
    TransferDoneCallback,
    TransferHold,
    TransportClient,
    TransportFault,
    TransportServer,
)

logger = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20
MAX_CONTROL_BYTES = 1 << 20

_HEADER = struct.Struct("!4sB3xIQ")
_MAGIC = b"TKV1"
_FETCH = 1
_LAYER = 2
_CONFIRM = 3
_DONE = 4
_ERROR = 5
_AWAIT = 6
_ANNOUNCE = 7
_HELD = 8
_HELD_FLAG = 1  # ANNOUNCE: the transfer it names is held for this connection
_EARLY_FLAG = 2  # ANNOUNCE: early; the announcement proper follows on the connection
AWAIT_POLL_S = 0.05  # how often a wait checks that its peer is still there (or cancelled)
RETRY_ATTEMPTS = 3  # tries of a request whose connection broke, the first included
RETRY_BACKOFF_S = 0.05  # the pause before the first retry, doubled before each next one


class _FetchRequest(msgspec.Struct):
    transfer_id: str
    layer_nbytes: list[int]
    release_only: bool = False  # no layers: the decode is done with the transfer without them
    hold: bool = False  # no layers: keep the transfer as published until CONFIRM


class _AwaitRequest(msgspec.Struct):
    handoff_id: str
    timeout_s: float
    hold: bool = False  # hold the transfer the announcement names for this connection
    early: bool = False  # take an early announcement (with hold): the announcement follows it


class _ErrorReply(msgspec.Struct):
    kind: str
    message: str


_fetch_decoder = msgspec.msgpack.Decoder(_FetchRequest)
_await_decoder = msgspec.msgpack.Decoder(_AwaitRequest)
_error_decoder = msgspec.msgpack.Decoder(_ErrorReply)
_announcement_decoder = msgspec.msgpack.Decoder(dict[str, Any])
_encoder = msgspec.msgpack.Encoder()


class _ProtocolError(Exception):
    """The peer sent something that is not this protocol, or closed mid-message."""


class _Cancelled(Exception):
    """The waiting side gave up (its request was aborted)."""


class _InjectedDrop(Exception):
    """A TransportFault asked the server to drop the connection here."""


class _Broken(Exception):
    """Client side: a request's connection broke, or could not be opened; worth another try."""

    def __init__(self, error: KVTransferError) -> None:
        super().__init__(str(error))
        self.error = error


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as a flat byte view (shared, not copied)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"KV staging tensors must be contiguous CPU tensors, got device={tensor.device} "
            f"contiguous={tensor.is_contiguous()}"
        )
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _configure_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket. With a deadline, raise TimeoutError once it passes; without,
    the socket's own timeout bounds each wait."""
    total = len(view)
    received = 0
    while received < total:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(remaining)
        count = sock.recv_into(view[received:], total - received)
        if count == 0:
            raise _ProtocolError(f"peer closed the connection after {received} of {total} bytes")
        received += count


def _recv_header(
    sock: socket.socket, buffer: bytearray, deadline: float | None = None
) -> tuple[int, int, int] | None:
    """Read one header: (type, layer, length), or None if the peer closed before its first byte."""
    view = memoryview(buffer)
    if deadline is not None:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    first = sock.recv_into(view, len(buffer))
    if first == 0:
        return None
    _recv_exact(sock, view[first:], deadline)
    magic, message_type, layer, length = _HEADER.unpack(buffer)
    if magic != _MAGIC:
        raise _ProtocolError(f"bad magic {magic!r}")
    return message_type, layer, length


def _recv_header_waiting(
    sock: socket.socket,
    buffer: bytearray,
    deadline: float,
    cancelled: threading.Event | None,
) -> tuple[int, int, int]:
    """Read one header that may be long in coming, checking `cancelled` every AWAIT_POLL_S."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(min(AWAIT_POLL_S, remaining))
        try:
            ready = sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            if cancelled is not None and cancelled.is_set():
                raise _Cancelled("cancelled while waiting") from None
            continue
        if not ready:
            raise _ProtocolError("the server closed the connection")
        message = _recv_header(sock, buffer, deadline)
        assert message is not None  # a byte is waiting
        return message


def _recv_control(
    sock: socket.socket, length: int, deadline: float | None = None
) -> bytes | bytearray:
    if length > MAX_CONTROL_BYTES:
        raise _ProtocolError(f"control message of {length} bytes is over {MAX_CONTROL_BYTES}")
    payload = bytearray(length)
    _recv_exact(sock, memoryview(payload), deadline)
    return payload


def _send_message(
    sock: socket.socket, message_type: int, payload: bytes = b"", layer: int = 0
) -> None:
    sock.sendall(_HEADER.pack(_MAGIC, message_type, layer, len(payload)) + payload)


@dataclass(eq=False)
class _Handoff:
    arrived: threading.Event = field(default_factory=threading.Event)
    message: dict[str, Any] | None = None
    expires: float = float("inf")  # what was announced (or kept early) is dropped after this
    waiter: socket.socket | None = None  # the connection of a decode worker waiting on it
    answered: bool = False  # the waiter got its one answer (set by whoever sends it)
    transfer_id: str | None = None  # the transfer the announcement names, to hold if asked
    early_message: dict[str, Any] | None = None  # made before anyone waited, for a later AWAIT
    hold_wanted: bool = False  # the waiter asked for that transfer held (AWAIT hold)
    early_wanted: bool = False  # the waiter takes an early announcement (AWAIT early)
    held: bool = False  # it is held for the waiter's connection, until CONFIRM or a drop

    @classmethod
    def renewed(cls, previous: _Handoff | None) -> _Handoff:
        """The record of a new wait: what `previous` (another wait's, whose client may come
        again after its connection broke) had announced or kept, none of that wait's state."""
        handoff = cls()
        if previous is not None:
            handoff.message, handoff.transfer_id = previous.message, previous.transfer_id
            handoff.early_message, handoff.expires = previous.early_message, previous.expires
            if previous.message is not None:
                handoff.arrived.set()
        return handoff


@dataclass(eq=False)
class _Transfer:
    layers: list[memoryview]
    wait_layer: Callable[[int], None] | None
    withdrawn: threading.Event = field(default_factory=threading.Event)
    holds: int = 0  # connections that hold it (a broken one may have come again meanwhile)


class TcpKVServer(TransportServer):
    """Prefill side: serves published transfers to decode workers over TCP.

    io_timeout bounds each wait on a client during a fetch: the send of one layer (so a layer
    must move at no less than its size / io_timeout) and the wait for CONFIRM. idle_timeout closes
    connections that carry no request for that long. With a cluster_token, only clients that
    prove it are served (`tandem.kv.auth`); handshake_timeout bounds a new client's handshake.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        on_transfer_done: TransferDoneCallback | None = None,
        on_transfer_held: Callable[[str], bool] | None = None,
        fault: TransportFault | None = None,
        io_timeout: float = 30.0,
        idle_timeout: float = 300.0,
        announcement_ttl: float = 60.0,
        cluster_token: str | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._key = derive_kv_key(cluster_token)
        self._handshake_timeout = handshake_timeout
        self._on_transfer_done = on_transfer_done
        self._on_transfer_held = on_transfer_held
        self._announcement_ttl = announcement_ttl
        self._handoffs: dict[str, _Handoff] = {}
        self._expiries: deque[tuple[float, str]] = deque()  # (expires, handoff id), in order
        # connections that got an early announcement and wait for the announcement proper
        self._early_waiters: dict[str, socket.socket] = {}
        self._fault = fault
        self._io_timeout = io_timeout
        self._idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._transfers: dict[str, _Transfer] = {}
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._num_faulted_fetches = 0
        self._connections_accepted = 0
        self._early_announcements = 0
        self._closing = threading.Event()

        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _configure_socket(self._listener)
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

    @property
    def early_announcements(self) -> int:
        """How many early announcements this server has sent so far."""
        return self._early_announcements

    def publish(
        self,
        transfer_id: str,
        layers: Sequence[torch.Tensor],
        wait_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Make `layers` (contiguous CPU tensors, any dtype) fetchable under transfer_id.

        wait_layer(i) blocks until layer i's bytes are valid; layer i is sent only after it
        returns. The tensors must stay untouched until the transfer is done or withdrawn.
        """
        transfer = _Transfer([_byte_view(layer) for layer in layers], wait_layer)
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
        with self._lock:  # one section: a wait sent a kept early announcement sees the message
            early_waiter = self._early_waiters.pop(handoff_id, None)
            self._drop_expired(now)
            handoff = self._handoffs.setdefault(handoff_id, _Handoff())
            handoff.message = message
            handoff.transfer_id = transfer_id
            self._expire(handoff_id, handoff, now)
            waiter = None if handoff.answered else handoff.waiter
            handoff.answered = handoff.answered or waiter is not None
        if early_waiter is not None:
            self._send_proper(early_waiter, handoff_id, message)
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

    def announce_early(self, handoff_id: str, transfer_id: str, message: dict[str, Any]) -> bool:
        """Send `message` ahead of the announcement proper to the decode worker waiting on
        handoff_id, with transfer_id held for it, if it waits already and asked for an early
        announcement (and a hold); when nobody waits yet, keep the message for an AWAIT (hold,
        early) that comes before the announcement proper. False when it was neither sent nor
        kept: `announce` then does all."""
        with self._lock:
            handoff = self._handoffs.setdefault(handoff_id, _Handoff())
            if handoff.answered or handoff.message is not None:
                return False
            if handoff.waiter is None:
                handoff.early_message = message
                handoff.transfer_id = transfer_id
                self._expire(handoff_id, handoff, time.monotonic())
                return True
            if not (handoff.early_wanted and handoff.hold_wanted):
                return False
        if not self._hold(transfer_id):
            return False
        with self._lock:
            waiter = None if handoff.answered else handoff.waiter
            if waiter is not None:
                handoff.answered = True
                handoff.early_message = message
                handoff.transfer_id = transfer_id
                handoff.held = True
        if waiter is None:  # it left, or was answered, meanwhile
            self._let_go(transfer_id)
            return False
        try:
            payload = _encoder.encode(message)
            _send_message(waiter, _ANNOUNCE, payload, layer=_HELD_FLAG | _EARLY_FLAG)
        except OSError as exc:  # the connection's thread finds it broken and lets go
            logger.debug("KV server on port %d: early %r failed: %r", self.port, handoff_id, exc)
            handoff.arrived.set()
            return False
        with self._lock:
            self._early_waiters[handoff_id] = waiter
            self._early_announcements += 1
        handoff.arrived.set()  # the connection's thread goes on to wait for CONFIRM
        return True

    def announce_more(self, handoff_id: str, message: dict[str, Any]) -> bool:
        """A further early announcement, to the decode worker that got the early one (from
        this thread, as `announce`), or added to the kept early message that no wait has taken
        yet. False when neither: a wait took the kept message meanwhile and is being sent it,
        or nothing was announced early."""
        with self._lock:
            waiter = self._early_waiters.get(handoff_id)
            if waiter is None:
                handoff = self._handoffs.get(handoff_id)
                kept = handoff is not None and handoff.early_message is not None
                if not kept or handoff.answered or handoff.message is not None:
                    return False
                handoff.early_message = {**handoff.early_message, **message}
                return True
        try:
            _send_message(waiter, _ANNOUNCE, _encoder.encode(message), layer=_EARLY_FLAG)
        except OSError as exc:  # the connection's thread sees the client gone, lets go
            logger.debug("KV server on port %d: early %r failed: %r", self.port, handoff_id, exc)
            return False
        return True

    def _expire(self, handoff_id: str, handoff: _Handoff, now: float) -> None:
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

    def _send_proper(self, connection: socket.socket, handoff_id: str, message: dict) -> None:
        """The announcement proper, to a waiter that got the early one."""
        try:
            _send_message(connection, _ANNOUNCE, _encoder.encode(message))
        except OSError as exc:  # the connection's thread sees the client gone, lets go
            logger.debug(
                "KV server on port %d: announcing %r failed: %r", self.port, handoff_id, exc
            )

    def close(self) -> None:
        """Stop accepting, forget every transfer, end every connection and join the threads."""
        with self._lock:
            self._closing.set()
            transfers = list(self._transfers.values())
            self._transfers.clear()
            connections = dict(self._connections)
        for transfer in transfers:
            transfer.withdrawn.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
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
        header = bytearray(_HEADER.size)
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            serve_handshake(connection, self._key, self._handshake_timeout)
            while not self._closing.is_set():
                connection.settimeout(self._idle_timeout)
                message = _recv_header(connection, header)
                if message is None:
                    return
                message_type, _, length = message
                if message_type not in (_FETCH, _AWAIT):
                    raise _ProtocolError(f"expected FETCH or AWAIT, got type {message_type}")
                connection.settimeout(self._io_timeout)
                payload = _recv_control(connection, length)
                if message_type == _AWAIT:
                    self._serve_await(connection, _await_decoder.decode(payload), header)
                else:
                    self._serve_fetch(connection, _fetch_decoder.decode(payload), header)
        except HandshakeRefused as exc:
            client = f"{address[0]}:{address[1]}"
            logger.warning(
                "KV server on port %d refused a client at %s: %s", self.port, client, exc
            )
        except (OSError, HandshakeError, _ProtocolError, _InjectedDrop, msgspec.DecodeError) as exc:
            logger.debug("KV server on port %d: connection ended: %r", self.port, exc)
        except Exception:
            logger.exception("KV server on port %d: connection handler failed", self.port)
        finally:
            with self._lock:
                self._connections.pop(connection, None)
            connection.close()

    def _serve_await(
        self, connection: socket.socket, request: _AwaitRequest, header: bytearray
    ) -> None:
        """Answer one AWAIT once its handoff is announced, or with a timeout error; an
        announcement that went out with its transfer held then waits for CONFIRM. Raises when
        the client leaves while waiting (the connection then closes)."""
        handoff_id = request.handoff_id
        with self._lock:
            handoff = self._handoffs.get(handoff_id)
            if handoff is None or handoff.waiter is not None or handoff.answered:
                handoff = self._handoffs[handoff_id] = _Handoff.renewed(handoff)
            handoff.waiter = connection  # an announcement from now on is sent by `announce`
            handoff.hold_wanted = request.hold
            handoff.early_wanted = request.early
            # an early announcement kept for this wait goes out from here, before the proper one
            take_early = request.hold and request.early and handoff.early_message is not None
            take_early = take_early and not handoff.answered and handoff.message is None
            handoff.answered = handoff.answered or take_early
        if take_early and self._send_kept_early(connection, handoff_id, handoff):
            with self._lock:
                self._forget_wait(handoff_id, handoff)
            self._serve_held(connection, handoff.transfer_id, header)
            return
        deadline = time.monotonic() + request.timeout_s
        try:
            while not handoff.arrived.wait(AWAIT_POLL_S):
                # `answered` is read after the liveness check: `announce` marks it before it
                # sends, so a client already talking about its next request is answered, not gone.
                gone = not _is_alive(connection) and not handoff.answered
                if self._closing.is_set() or gone:
                    raise _ProtocolError(f"the client stopped waiting for {handoff_id!r}")
                if time.monotonic() > deadline or handoff.answered:
                    break
        finally:
            connection.settimeout(self._io_timeout)
            with self._lock:
                self._forget_wait(handoff_id, handoff)
                answer_here = not handoff.answered
                handoff.answered = True
        if answer_here and handoff.message is None:
            self._send_error(
                connection, "timeout", f"nothing was announced for {handoff_id!r} in time"
            )
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

    def _forget_wait(self, handoff_id: str, handoff: _Handoff) -> None:
        """The wait on `handoff` is over (called under the lock): it has no waiter to send to;
        with nothing announced it is no longer listed (a later AWAIT for its id starts afresh),
        else it stays until it expires (a later AWAIT gets the announcement again)."""
        if self._handoffs.get(handoff_id) is handoff and handoff.message is None:
            del self._handoffs[handoff_id]
        handoff.waiter = None

    def _send_kept_early(
        self, connection: socket.socket, handoff_id: str, handoff: _Handoff
    ) -> bool:
        """An AWAIT (hold, early) that came after `announce_early` kept its message: hold the
        transfer, send that message, then the announcement proper if `announce` came meanwhile
        (else `announce` sends it). False when the transfer could not be held: the waiter then
        waits for the announcement proper as any other."""
        transfer_id = handoff.transfer_id
        if not self._hold(transfer_id):
            with self._lock:
                handoff.answered = False  # an `announce` meanwhile left the answer to this wait
            return False
        handoff.held = True
        try:
            payload = _encoder.encode(handoff.early_message)
            _send_message(connection, _ANNOUNCE, payload, layer=_HELD_FLAG | _EARLY_FLAG)
        except BaseException:
            self._let_go(transfer_id)
            raise
        with self._lock:
            self._early_announcements += 1
            proper = handoff.message  # set by an `announce` that found no early waiter
            if proper is None:
                self._early_waiters[handoff_id] = connection
        if proper is not None:
            self._send_proper(connection, handoff_id, proper)
        return True

    def _serve_held(self, connection: socket.socket, transfer_id: str, header: bytearray) -> None:
        """After an announcement that went out with its transfer held: wait for CONFIRM."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
        if transfer is None:  # a held transfer stays published until the server closes
            raise _ProtocolError(f"held transfer {transfer_id!r} is gone")
        self._serve_hold(connection, transfer_id, transfer, header)

    def _send_announcement(self, connection: socket.socket, handoff: _Handoff) -> None:
        """Send the handoff's announcement, holding its transfer first if the waiter asked."""
        if handoff.hold_wanted and handoff.transfer_id is not None and not handoff.held:
            with self._lock:
                transfer = self._transfers.get(handoff.transfer_id)
            if transfer is not None and not transfer.layers:  # as FETCH (hold): no layers
                handoff.held = self._hold(handoff.transfer_id)
        payload = _encoder.encode(handoff.message)
        _send_message(connection, _ANNOUNCE, payload, layer=_HELD_FLAG if handoff.held else 0)

    def _serve_fetch(
        self, connection: socket.socket, request: _FetchRequest, header: bytearray
    ) -> None:
        """Serve one fetch. Returns with the connection ready for the next request; raises (after
        reporting a broken fetch) when the connection must close."""
        transfer_id = request.transfer_id
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            fault = self._take_fault() if transfer is not None else None
        if transfer is None:
            self._send_error(connection, "not_found", f"no published transfer {transfer_id!r}")
            return
        if request.release_only:
            self._finish(connection, transfer_id, transfer)
            return
        published_nbytes = [len(layer) for layer in transfer.layers]
        if request.layer_nbytes != published_nbytes:
            self._report_done(transfer_id, transfer, False)
            self._send_error(
                connection,
                "mismatch",
                f"transfer {transfer_id!r} has layers of {published_nbytes} bytes, "
                f"the destination has {request.layer_nbytes}",
            )
            return
        if request.hold:
            if fault is not None:  # a hold has no layers: a drop comes before HELD
                self._closing.wait(fault.delay_s)
                if fault.drop_after_layers is not None:
                    self._report_done(transfer_id, transfer, False)
                    raise _InjectedDrop("injected drop before HELD")
                fault = None
            if not self._hold(transfer_id):
                self._send_error(connection, "aborted", f"transfer {transfer_id!r} has ended")
                return
            _send_message(connection, _HELD)
            self._serve_hold(connection, transfer_id, transfer, header)
            return
        try:
            outcome = self._stream_layers(connection, transfer_id, transfer, fault, header)
        except BaseException:
            self._report_done(transfer_id, transfer, False)
            raise
        if outcome == "confirmed":
            self._finish(connection, transfer_id, transfer)
        elif outcome == "failed":
            self._report_done(transfer_id, transfer, False)

    def _stream_layers(
        self,
        connection: socket.socket,
        transfer_id: str,
        transfer: _Transfer,
        fault: TransportFault | None,
        header: bytearray,
    ) -> Literal["confirmed", "withdrawn", "failed"]:
        """Send every layer, then wait for CONFIRM. Raises when the connection must close."""
        drop_at = None
        if fault is not None:
            self._closing.wait(fault.delay_s)
            if fault.drop_after_layers is not None:
                drop_at = min(fault.drop_after_layers, len(transfer.layers))
        for index, layer in enumerate(transfer.layers):
            if drop_at == index:
                raise _InjectedDrop(f"injected drop after {index} layers")
            if transfer.wait_layer is not None:
                try:
                    transfer.wait_layer(index)
                except Exception as exc:
                    logger.exception("wait_layer(%d) of transfer %r failed", index, transfer_id)
                    self._send_error(connection, "aborted", f"layer {index} failed: {exc!r}")
                    return "failed"
            if transfer.withdrawn.is_set():
                self._send_error(connection, "aborted", f"transfer {transfer_id!r} was withdrawn")
                return "withdrawn"
            connection.sendall(_HEADER.pack(_MAGIC, _LAYER, index, len(layer)))
            connection.sendall(layer)
        if drop_at == len(transfer.layers):
            raise _InjectedDrop(f"injected drop after all {drop_at} layers, before CONFIRM")
        message = _recv_header(connection, header)
        if message is None or message[0] != _CONFIRM or message[2] != 0:
            raise _ProtocolError(f"expected CONFIRM, got {message}")
        return "confirmed"

    def _serve_hold(
        self, connection: socket.socket, transfer_id: str, transfer: _Transfer, header: bytearray
    ) -> None:
        """A held transfer: wait for the client's CONFIRM, then answer DONE. Lets go of the
        transfer (on_transfer_done(id, False)) and raises when the connection must close."""
        try:
            message = _recv_header(connection, header)
            if message is None or message[0] != _CONFIRM or message[2] != 0:
                raise _ProtocolError(f"expected CONFIRM, got {message}")
        except BaseException:
            self._let_go(transfer_id)
            raise
        self._finish(connection, transfer_id, transfer)

    def _finish(self, connection: socket.socket, transfer_id: str, transfer: _Transfer) -> None:
        with self._lock:
            completed = self._transfers.get(transfer_id) is transfer
            if completed:
                del self._transfers[transfer_id]
        if not completed:
            self._send_error(connection, "aborted", f"transfer {transfer_id!r} was withdrawn")
            return
        try:
            _send_message(connection, _DONE)
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

    def _take_fault(self) -> TransportFault | None:
        """The fault to inject into the fetch starting now (call under the lock)."""
        fault = self._fault
        if fault is None or (fault.times is not None and self._num_faulted_fetches >= fault.times):
            return None
        self._num_faulted_fetches += 1
        return fault

    def _report_done(self, transfer_id: str, transfer: _Transfer, ok: bool) -> None:
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

    @staticmethod
    def _send_error(connection: socket.socket, kind: str, message: str) -> None:
        _send_message(connection, _ERROR, _encoder.encode(_ErrorReply(kind, message)))


class TcpKVClient(TransportClient):
    """Decode side: fetches transfers from TcpKVServers, reusing one idle connection per fetch.

    Thread-safe: concurrent fetches each take their own connection; a connection goes back to the
    idle pool (at most `max_idle_per_peer` per (host, port)) only after a fetch that ended cleanly.
    A new connection passes the handshake (`tandem.kv.auth`, proving cluster_token if given)
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
    ) -> None:
        """Receive every layer into dest_layers (contiguous CPU tensors of the published byte
        sizes), calling on_layer(i) as each arrives, then confirm. When this returns, the server
        has recorded the confirmation and forgotten the transfer; its on_transfer_done(id, True)
        runs right after it sent that answer. Raises KVTransferError on timeout (overall deadline),
        connection loss, unknown id, withdrawal or a size mismatch; an exception from on_layer
        propagates as is. A fetch tried again after a break gets the layers again (the same
        bytes) and reports only those not reported before; one that broke with every layer in
        only confirms."""
        views = [_byte_view(layer) for layer in dest_layers]
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
                self._exchange(connection, transfer_id, views, deadline, report)

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

    def hold(self, host: str, port: int, transfer_id: str, *, timeout: float) -> TransferHold:
        """Ask the server to hold the transfer (the hold is on its way when this returns).
        Raises KVTransferError as fetch does; `timeout` bounds the hold's whole life. Until
        HELD, a connection that breaks is replaced and the hold asked for again."""
        deadline = time.monotonic() + timeout
        request = _encoder.encode(_FetchRequest(transfer_id, [], hold=True))
        what = f"hold of {transfer_id!r}"
        hold = _TcpTransferHold(self, (host, port), None, what, timeout, deadline, request=request)
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
    ) -> dict[str, Any]:
        """Wait until the server's side announces handoff_id and return what it announced.
        Raises KVTransferError: "timeout" when nothing came within `timeout`, "aborted" once
        `cancelled` is set (checked every AWAIT_POLL_S), and as fetch does otherwise."""

        def exchange(connection: socket.socket, deadline: float) -> dict[str, Any]:
            message, _ = self._await(connection, deadline, handoff_id, cancelled)
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
        early: bool = False,
    ) -> tuple[dict[str, Any], TransferHold | None]:
        """As await_announcement, asking the server to hold the transfer the announcement names
        for this connection. Returns the announcement and the hold when the server holds it
        (already held: no wait; `hold_timeout` bounds the rest of its life), else None. With
        `early`, the message may be an early announcement: the hold then says so
        (`announcement_pending`) and `hold.announcement()` brings the announcement proper."""

        def exchange(
            connection: socket.socket, deadline: float
        ) -> tuple[dict[str, Any], TransferHold | None]:
            message, flags = self._await(
                connection, deadline, handoff_id, cancelled, hold=True, early=early
            )
            if not flags & _HELD_FLAG:
                return message, None
            hold_deadline = time.monotonic() + hold_timeout
            peer = (host, port)
            what = f"hold of the transfer announced for {handoff_id!r}"
            hold = _TcpTransferHold(
                self, peer, connection, what, hold_timeout, hold_deadline, held=True
            )
            hold.handoff_id = handoff_id
            hold.announcement_pending = bool(flags & _EARLY_FLAG)
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
        hold: bool = False,
        early: bool = False,
    ) -> tuple[dict[str, Any], int]:
        """One AWAIT (until the deadline): the announcement, and its flags (_HELD_FLAG: its
        transfer is held for this connection; _EARLY_FLAG: an early one)."""
        timeout = max(deadline - time.monotonic(), 0.0)
        request = _encoder.encode(_AwaitRequest(handoff_id, timeout, hold, early))
        connection.settimeout(max(deadline - time.monotonic(), 1e-3))
        _send_message(connection, _AWAIT, request)
        header = bytearray(_HEADER.size)
        message_type, flags, length = _recv_header_waiting(connection, header, deadline, cancelled)
        if message_type == _ERROR:
            self._raise_error_reply(connection, length, deadline)
        allowed = {0}
        if hold:
            allowed.add(_HELD_FLAG)
            if early:
                allowed.add(_HELD_FLAG | _EARLY_FLAG)
        if message_type != _ANNOUNCE or flags not in allowed:
            raise _ProtocolError(f"expected ANNOUNCE, got message type {message_type} ({flags})")
        message = _announcement_decoder.decode(_recv_control(connection, length, deadline))
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
                _raise_transport_error(exc, what, peer, timeout, retryable=True)
            if keeps_connection is None or not keeps_connection(result):
                self._checkin(peer, connection)
            return result

        return self._retrying(deadline, attempt)

    def _retrying(self, deadline: float, attempt: Callable[[], Any]) -> Any:
        """attempt() again, after a pause, each time it raises _Broken: retry_attempts tries in
        all, while the pause ends before the deadline; then the last failure is raised."""
        pause = RETRY_BACKOFF_S
        for number in range(1, self._retry_attempts + 1):
            try:
                return attempt()
            except _Broken as broken:
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
        release_only: bool = False,
    ) -> None:
        """Run one fetch on the connection until DONE; the server's ERROR reply is raised as a
        KVTransferError."""
        request = _encoder.encode(
            _FetchRequest(transfer_id, [len(view) for view in views], release_only)
        )
        connection.settimeout(max(deadline - time.monotonic(), 1e-3))
        _send_message(connection, _FETCH, request)
        header = bytearray(_HEADER.size)
        if release_only:
            self._await_done(connection, header, deadline)
            return
        for index, view in enumerate(views):
            message_type, layer, length = self._recv_reply(connection, header, deadline)
            if message_type == _ERROR:
                self._raise_error_reply(connection, length, deadline)
            if message_type != _LAYER or layer != index or length != len(view):
                raise _ProtocolError(
                    f"expected layer {index} of {len(view)} bytes, got message type "
                    f"{message_type} layer {layer} of {length} bytes"
                )
            _recv_exact(connection, view, deadline)
            if on_layer is not None:
                on_layer(index)
        connection.settimeout(max(deadline - time.monotonic(), 1e-3))
        _send_message(connection, _CONFIRM)
        self._await_done(connection, header, deadline)

    def _await_done(self, connection: socket.socket, header: bytearray, deadline: float) -> None:
        message_type, _, length = self._recv_reply(connection, header, deadline)
        if message_type == _ERROR:
            self._raise_error_reply(connection, length, deadline)
        if message_type != _DONE or length != 0:
            raise _ProtocolError(f"expected DONE, got message type {message_type}")

    @staticmethod
    def _recv_reply(
        connection: socket.socket, header: bytearray, deadline: float
    ) -> tuple[int, int, int]:
        message = _recv_header(connection, header, deadline)
        if message is None:
            raise _ProtocolError("the server closed the connection")
        return message

    @staticmethod
    def _raise_error_reply(connection: socket.socket, length: int, deadline: float) -> NoReturn:
        """Read the server's ERROR reply and raise it (the connection stays usable)."""
        error = _error_decoder.decode(_recv_control(connection, length, deadline))
        if error.kind not in TRANSFER_ERROR_KINDS:
            raise _ProtocolError(f"unknown error kind {error.kind!r}")
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
            if _is_alive(connection):
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
        """A new connection that passed the handshake (by the handshake timeout at most).
        Raises _Broken when it could not be opened or broke; KVTransferError for the rest."""
        host, port = peer
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )[0]
            connection = socket.socket(family, kind, proto)
        except OSError as exc:
            raise KVTransferError("connection", f"cannot resolve {host}:{port}: {exc}") from exc
        try:
            _configure_socket(connection)
            connection.settimeout(max(deadline - time.monotonic(), 1e-3))
            connection.connect(address)
            handshake_deadline = min(deadline, time.monotonic() + self._handshake_timeout)
            open_handshake(connection, self._key, peer, handshake_deadline)
        except KVTransferError:
            connection.close()
            raise
        except TimeoutError as exc:
            connection.close()
            raise KVTransferError("timeout", f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            connection.close()
            error = KVTransferError("connection", f"cannot connect to {host}:{port}: {exc}")
            raise _Broken(error) from exc
        return connection


class _TcpTransferHold(TransferHold):
    """A hold on one pooled connection: FETCH (hold) sent, then HELD awaited, then CONFIRM; or
    one an announcement came with (held already: nothing to wait for), then CONFIRM. Until
    HELD, or the announcement proper after an early one, a connection that broke is replaced
    and the hold asked for again (with that announcement)."""

    def __init__(
        self,
        client: TcpKVClient,
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
        self.handoff_id = ""  # an early announcement's: to wait again after a break
        self._header = bytearray(_HEADER.size)
        self._held = held

    def ask(self) -> None:
        """Send the FETCH (hold), on a new connection when there is none (the last broke)."""
        if self._connection is None:
            self._connection = self._client._checkout(self._peer, self._deadline)
        request = self._request
        self.step(lambda c: _send_message(c, _FETCH, request), last=False, retryable=True)

    def wait(self) -> None:
        if self._held:
            return

        def expect_held(connection: socket.socket) -> None:
            message_type, _, length = TcpKVClient._recv_reply(
                connection, self._header, self._deadline
            )
            if message_type == _ERROR:
                TcpKVClient._raise_error_reply(connection, length, self._deadline)
            if message_type != _HELD or length != 0:
                raise _ProtocolError(f"expected HELD, got message type {message_type}")

        def attempt() -> None:
            if self._connection is None:  # the connection the hold went out on broke
                self.ask()
            self.step(expect_held, last=False, retryable=True)

        self._ensure_open()
        self._client._retrying(self._deadline, attempt)
        self._held = True

    def announcement(self, cancelled: threading.Event | None = None) -> dict[str, Any]:
        if not self.announcement_pending:
            raise RuntimeError("no announcement is due on this hold")

        def receive(connection: socket.socket) -> None:
            message_type, flags, length = _recv_header_waiting(
                connection, self._header, self._deadline, cancelled
            )
            if message_type != _ANNOUNCE or flags not in (0, _EARLY_FLAG):
                raise _ProtocolError(f"expected ANNOUNCE, got message type {message_type}")
            received.append(
                _announcement_decoder.decode(_recv_control(connection, length, self._deadline))
            )
            self.announcement_pending = flags == _EARLY_FLAG

        def wait_again(connection: socket.socket) -> None:
            message, flags = self._client._await(
                connection, self._deadline, self.handoff_id, cancelled, hold=True
            )
            if not flags & _HELD_FLAG:  # the lease ended meanwhile: the copy is not safe
                raise KVTransferError("aborted", f"{self._what} ended while its connection broke")
            received.append(message)
            self.announcement_pending = False

        def attempt() -> None:
            if self._connection is None:  # it broke: the announcement proper, held anew
                self._connection = self._client._checkout(self._peer, self._deadline)
                self.step(wait_again, last=False, retryable=True)
            else:
                self.step(receive, last=False, retryable=True)

        received: list[dict[str, Any]] = []
        self._ensure_open()
        self._client._retrying(self._deadline, attempt)
        return received[0]

    def _ensure_open(self) -> None:
        """Before a retried part: a hold given up (or ended) is not taken up again."""
        if self._connection is None:
            raise KVTransferError("aborted", f"{self._what} has ended")

    def release(self) -> None:
        def confirm(connection: socket.socket) -> None:
            _send_message(connection, _CONFIRM)
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
        _Broken for a retry if `retryable`)."""
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
            _raise_transport_error(exc, self._what, self._peer, self._timeout, retryable)
        if last:
            self._connection = None
            self._client._checkin(self._peer, connection)


def _as_transfer_error(
    exc: BaseException, what: str, peer: tuple[str, int], timeout: float
) -> KVTransferError | None:
    """The KVTransferError a broken exchange reports, or None for errors that are not the
    transport's."""
    host, port = peer
    if isinstance(exc, _Cancelled):
        return KVTransferError("aborted", f"{what} was cancelled")
    if isinstance(exc, TimeoutError):
        return KVTransferError("timeout", f"{what} from {host}:{port} passed {timeout} s")
    if isinstance(exc, (OSError, _ProtocolError, msgspec.DecodeError)):
        return KVTransferError("connection", f"{what} from {host}:{port} broke: {exc!r}")
    return None


def _raise_transport_error(
    exc: BaseException, what: str, peer: tuple[str, int], timeout: float, retryable: bool
) -> NoReturn:
    """Raise what a broken exchange reports: _Broken for a connection that broke when
    `retryable`, else the KVTransferError of `_as_transfer_error`; `exc` if not the transport's."""
    error = _as_transfer_error(exc, what, peer, timeout)
    if error is None:
        raise exc
    if retryable and error.kind == "connection":
        raise _Broken(error) from exc
    raise error from exc


def _is_alive(connection: socket.socket) -> bool:
    """Whether an idle connection is still open: no EOF, no error, no unread bytes pending."""
    try:
        connection.setblocking(False)
        connection.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False
