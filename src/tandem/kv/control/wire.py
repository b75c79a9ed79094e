"""The KV control plane's wire: framing, message types and the socket helpers both sides use.

Every message is a 20-byte header, then `length` payload bytes (docs/protocol.md, "The KV
port"); control payloads are msgpack (the structs below), at most MAX_CONTROL_BYTES; a LAYER's
payload is raw KV bytes. Invariants: a reader never trusts a length before checking it, and
every wait on a socket is bounded (a deadline, or the socket's timeout).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

import msgspec
import torch

SOCKET_BUFFER_BYTES = 4 << 20
# TCP keepalive on every KV connection (the server's listener passes it to each one it accepts):
# a peer that went away without a word (its host down, or a reset that reached the peer alone)
# is found within KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S of silence (at the
# first probe where its host answers with a reset), not at the end of a wait that may last
# minutes (a handoff's).
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3
MAX_CONTROL_BYTES = 1 << 20

HEADER = struct.Struct("!4sB3xIQ")
MAGIC = b"TKV1"
FETCH = 1
LAYER = 2
CONFIRM = 3
DONE = 4
ERROR = 5
AWAIT = 6
ANNOUNCE = 7
HELD = 8
HELD_FLAG = 1  # ANNOUNCE: the transfer it names is held for this connection
# CONFIRM of a hold: layer = 1 + the blocks the client read in place; 0 says nothing (an older
# client), and the whole transfer counts as read
AWAIT_POLL_S = 0.05  # how often a wait checks that its peer is still there (or cancelled)


class FetchRequest(msgspec.Struct):
    transfer_id: str
    layer_nbytes: list[int]  # what the client receives of each layer (from first_block on)
    release_only: bool = False  # no layers: the decode is done with the transfer without them
    hold: bool = False  # no layers: keep the transfer as published until CONFIRM
    first_block: int = 0  # each layer [2, blocks, ...] is sent from this block on


class AwaitRequest(msgspec.Struct):
    handoff_id: str
    timeout_s: float
    hold: bool = False  # hold the transfer the announcement names for this connection
    engine_id: str | None = None  # the prefill engine that announces (None: whichever serves)


class ErrorReply(msgspec.Struct):
    kind: str
    message: str


fetch_decoder = msgspec.msgpack.Decoder(FetchRequest)
await_decoder = msgspec.msgpack.Decoder(AwaitRequest)
error_decoder = msgspec.msgpack.Decoder(ErrorReply)
announcement_decoder = msgspec.msgpack.Decoder(dict[str, Any])
encoder = msgspec.msgpack.Encoder()


class ProtocolError(Exception):
    """The peer sent something that is not this protocol, or closed mid-message."""


class Cancelled(Exception):
    """The waiting side gave up (its request was aborted)."""


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as a flat byte view (shared, not copied)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"KV staging tensors must be contiguous CPU tensors, got device={tensor.device} "
            f"contiguous={tensor.is_contiguous()}"
        )
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def block_shape(layer: torch.Tensor) -> tuple[int, int] | None:
    """(parts, blocks) of a layer [parts, blocks, ...], where a fetch may start at a block."""
    return (layer.shape[0], layer.shape[1]) if layer.dim() >= 2 else None


def fetched_parts(
    layers: list[memoryview], shapes: list[tuple[int, int] | None], request: FetchRequest
) -> list[list[memoryview]]:
    """What a fetch gets of each layer (the layers' bytes, `shapes` their block_shape): the
    bytes of layer[:, first_block:], one slice per part (the whole layer from block 0). Raises
    ValueError when the request's sizes or first block do not fit the layers."""
    first_block, sent = request.first_block, []
    for layer, shape in zip(layers, shapes, strict=True):
        if first_block == 0:
            sent.append([layer])
            continue
        if shape is None or not 0 < first_block < shape[1]:
            blocks = "no blocks" if shape is None else f"{shape[1]} blocks"
            raise ValueError(
                f"has {blocks} per layer, the destination asks from block {first_block}"
            )
        parts, blocks = shape
        part_bytes = len(layer) // parts
        start = first_block * (part_bytes // blocks)
        sent.append([layer[p * part_bytes + start : (p + 1) * part_bytes] for p in range(parts)])
    sent_nbytes = [sum(len(part) for part in parts) for parts in sent]
    if request.layer_nbytes != sent_nbytes:
        from_block = f" from block {first_block}" if first_block else ""
        raise ValueError(
            f"has layers of {sent_nbytes} bytes{from_block}, the destination has "
            f"{request.layer_nbytes}"
        )
    return sent


def fetched_size(
    sent: list[list[memoryview]], shapes: list[tuple[int, int] | None], first_block: int
) -> tuple[int, int | None]:
    """What a fetch gets (`sent`, from fetched_parts): its bytes, and the blocks of each layer
    (None: the layers have no blocks)."""
    shape = shapes[0] if shapes else None
    blocks = None if shape is None else shape[1] - first_block
    return sum(len(part) for parts in sent for part in parts), blocks


def confirm_layer(blocks_read: int | None) -> int:
    """The layer field of a hold's CONFIRM that says how many blocks the client read."""
    return 0 if blocks_read is None else blocks_read + 1


def blocks_read(confirm_layer: int) -> int | None:
    """The blocks a hold's CONFIRM says the client read (None: it does not say)."""
    return confirm_layer - 1 if confirm_layer else None


def send_error(sock: socket.socket, kind: str, message: str) -> None:
    send_message(sock, ERROR, encoder.encode(ErrorReply(kind, message)))


def configure_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive times apply
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
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
            raise ProtocolError(f"peer closed the connection after {received} of {total} bytes")
        received += count


def recv_header(
    sock: socket.socket, buffer: bytearray, deadline: float | None = None
) -> tuple[int, int, int] | None:
    """Read one header: (type, layer, length), or None if the peer closed before its first byte."""
    view = memoryview(buffer)
    if deadline is not None:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    first = sock.recv_into(view, len(buffer))
    if first == 0:
        return None
    recv_exact(sock, view[first:], deadline)
    magic, message_type, layer, length = HEADER.unpack(buffer)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    return message_type, layer, length


def recv_header_waiting(
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
                raise Cancelled("cancelled while waiting") from None
            continue
        if not ready:
            raise ProtocolError("the server closed the connection")
        message = recv_header(sock, buffer, deadline)
        assert message is not None  # a byte is waiting
        return message


def recv_control(
    sock: socket.socket, length: int, deadline: float | None = None
) -> bytes | bytearray:
    if length > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control message of {length} bytes is over {MAX_CONTROL_BYTES}")
    payload = bytearray(length)
    recv_exact(sock, memoryview(payload), deadline)
    return payload


def send_message(
    sock: socket.socket, message_type: int, payload: bytes = b"", layer: int = 0
) -> None:
    sock.sendall(HEADER.pack(MAGIC, message_type, layer, len(payload)) + payload)


def is_alive(connection: socket.socket) -> bool:
    """Whether an idle connection is still open: no EOF, no error, no unread bytes pending."""
    try:
        connection.setblocking(False)
        connection.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False
