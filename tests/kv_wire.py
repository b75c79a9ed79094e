"""Helpers of the KV transport's tests: the KV port's wire format written out independently of
`tandem.kv` (from its documentation), for tests that talk to a KV server as a raw client or play
one to a client; a recorder of a server's on_transfer_done calls; staging layers to move."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading

import torch

# every message after the handshake: magic | type u8 | 3 pad bytes | layer u32 | length u64
WIRE_HEADER = struct.Struct("!4sB3xIQ")
FETCH, LAYER, CONFIRM, DONE, ERROR, AWAIT, ANNOUNCE = 1, 2, 3, 4, 5, 6, 7

# the handshake: magic | version u16 | flags u16, then nonces and proofs of 32 bytes
HANDSHAKE_HEAD = struct.Struct("!4sHH")
VERSION = 1
HELLO_BYTES = HANDSHAKE_HEAD.size + 32
VERDICT_BYTES = HANDSHAKE_HEAD.size + 32


def kv_key(token: str) -> bytes:
    return hmac.new(token.encode(), b"tandem kv v1", hashlib.sha256).digest()


def mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = sock.recv(count - len(chunks))
        assert chunk, "the peer closed the connection early"
        chunks += chunk
    return bytes(chunks)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (an orderly close, or a reset when it left
    unread bytes behind), reading past whatever it sent before."""
    try:
        while True:
            if sock.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def raw_handshake(sock: socket.socket, token: str | None = None, proof: bytes | None = None):
    """The client's side of the handshake: HELLO in, AUTH out (proving `token`, or sending
    `proof` as is), VERDICT in. Returns (hello flags, verdict flags)."""
    hello = recv_exact(sock, HELLO_BYTES)
    magic, version, hello_flags = HANDSHAKE_HEAD.unpack_from(hello)
    assert (magic, version) == (b"TKVH", VERSION)
    server_nonce, client_nonce = hello[HANDSHAKE_HEAD.size :], os.urandom(32)
    if token is not None:
        proof = mac(kv_key(token), b"client", server_nonce, client_nonce)
    flags = 0 if proof is None else 1
    auth = HANDSHAKE_HEAD.pack(b"TKVA", VERSION, flags) + client_nonce + (proof or bytes(32))
    sock.sendall(auth)
    verdict = recv_exact(sock, VERDICT_BYTES)
    magic, _, verdict_flags = HANDSHAKE_HEAD.unpack_from(verdict)
    assert magic == b"TKVV"
    if token is not None and verdict_flags & 1:
        assert verdict[HANDSHAKE_HEAD.size :] == mac(
            kv_key(token), b"server", client_nonce, server_nonce
        )
    return hello_flags, verdict_flags


def raw_connect(port: int, handshake: bool = True, token: str | None = None) -> socket.socket:
    """A raw connection to a KV server, past an accepted handshake unless `handshake` is off."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    if handshake:
        _, verdict_flags = raw_handshake(sock, token)
        assert verdict_flags & 1, "the server refused the handshake"
    return sock


def message(message_type: int, payload: bytes = b"", layer: int = 0) -> bytes:
    return WIRE_HEADER.pack(b"TKV1", message_type, layer, len(payload)) + payload


class DoneRecorder:
    """Collects on_transfer_done calls; lets a test wait for them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self._condition = threading.Condition()

    def __call__(self, transfer_id: str, ok: bool) -> None:
        with self._condition:
            self.calls.append((transfer_id, ok))
            self._condition.notify_all()

    def wait_for(self, count: int, timeout: float = 5.0) -> list[tuple[str, bool]]:
        with self._condition:
            self._condition.wait_for(lambda: len(self.calls) >= count, timeout)
            return list(self.calls)


def make_layers(seed: int, num_layers: int = 4, num_blocks: int = 5) -> list[torch.Tensor]:
    """Staging tensors [2, blocks, block_size, kv_heads, head_dim], float32 and bfloat16 mixed."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for index in range(num_layers):
        dtype = torch.float32 if index % 2 == 0 else torch.bfloat16
        layers.append(torch.randn(2, num_blocks, 16, 3, 64, generator=generator).to(dtype))
    return layers


def layer_bytes(layer: torch.Tensor) -> bytes:
    return layer.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_layers(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for index, (got_layer, want_layer) in enumerate(zip(got, want, strict=True)):
        assert got_layer.dtype == want_layer.dtype, f"layer {index}"
        assert layer_bytes(got_layer) == layer_bytes(want_layer), f"layer {index} differs"


def zeros_like_all(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(layer) for layer in layers]
