"""The KV plane's handshake: both ends of a new KV connection prove the cluster token.

    server -> client  HELLO    b"TKVH" | version u16 | flags u16 | server nonce (32 bytes)
                               flags 1: the server has a cluster token and wants a proof
    client -> server  AUTH     b"TKVA" | version u16 | flags u16 | client nonce (32) | proof (32)
                               flags 1: proof = HMAC(key, "client" | server nonce | client nonce)
    server -> client  VERDICT  b"TKVV" | version u16 | flags u16 | proof (32)
                               flags 1: accepted; 2: proof = HMAC(key, "server" | client nonce |
                               server nonce)

key = HMAC-SHA256(cluster token, "tandem kv v1"); every HMAC is HMAC-SHA256, checked in constant
time. The server speaks first, on every new connection, and reads no request before it accepted
the client; the client sends none before it checked the server's proof, so it reads no KV byte
from a server that does not know the token. The server refuses a client whose proof is missing or
wrong, or who offers one it cannot check (it has no token); the client refuses a server that
does not prove the token it has. With a token on neither side the exchange still runs, without
proofs: a port that does not speak this protocol fails within the handshake timeout.

Guarantees: both sides hold the key when the handshake ends; fresh nonces on both sides make a
recorded exchange worthless. Not: secrecy or integrity of what follows (nothing is encrypted or
signed per message), so an active man in the middle can still read or change the stream.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

from tandem.kv.errors import KVTransferError

HANDSHAKE_TIMEOUT_S = 5.0  # how long either side waits for the other's part of the handshake
PROTOCOL_VERSION = 1
NONCE_BYTES = 32
KEY_LABEL = b"tandem kv v1"
SAME_TOKEN_HINT = "give both workers the same --cluster-token"

_HEAD = struct.Struct("!4sHH")
_HELLO, _AUTH, _VERDICT = b"TKVH", b"TKVA", b"TKVV"
_PROOF_WANTED = _PROOF_GIVEN = _ACCEPTED = 1
_SERVER_PROOF = 2
_HELLO_BYTES = _HEAD.size + NONCE_BYTES
_AUTH_BYTES = _HEAD.size + NONCE_BYTES + NONCE_BYTES
_VERDICT_BYTES = _HEAD.size + NONCE_BYTES
_NO_PROOF = bytes(NONCE_BYTES)


class HandshakeError(Exception):
    """Server side: the client does not speak the protocol, or left during the handshake."""


class HandshakeRefused(HandshakeError):
    """Server side: the client was refused (its proof, or its protocol version); worth a log."""


def derive_kv_key(cluster_token: str | None) -> bytes | None:
    """The KV plane's key from the cluster token (None: no token, no key)."""
    if cluster_token is None:
        return None
    return hmac.new(cluster_token.encode("utf-8"), KEY_LABEL, hashlib.sha256).digest()


def proof(key: bytes, side: bytes, first_nonce: bytes, second_nonce: bytes) -> bytes:
    """What `side` (b"client" or b"server") sends to prove the key, over both nonces."""
    return hmac.new(key, side + first_nonce + second_nonce, hashlib.sha256).digest()


def proves(
    key: bytes, side: bytes, first_nonce: bytes, second_nonce: bytes, candidate: bytes
) -> bool:
    return hmac.compare_digest(proof(key, side, first_nonce, second_nonce), candidate)


def serve_handshake(connection: socket.socket, key: bytes | None, timeout: float) -> None:
    """Server side, right after accept: greet, then check the client's AUTH and answer it.
    Returns once the client is accepted; raises HandshakeRefused (after telling the client) or
    HandshakeError, or the socket's OSError / TimeoutError."""
    deadline = time.monotonic() + timeout
    server_nonce = os.urandom(NONCE_BYTES)
    flags = _PROOF_WANTED if key is not None else 0
    connection.settimeout(timeout)
    connection.sendall(_HEAD.pack(_HELLO, PROTOCOL_VERSION, flags) + server_nonce)
    answer = _recv_exactly(connection, _AUTH_BYTES, deadline)
    magic, version, client_flags = _HEAD.unpack_from(answer)
    if magic != _AUTH:
        raise HandshakeError(f"expected AUTH, got {answer[:8]!r}")
    client_nonce = answer[_HEAD.size : _HEAD.size + NONCE_BYTES]
    client_proof = answer[_HEAD.size + NONCE_BYTES :]
    refusal = None
    if version != PROTOCOL_VERSION:
        refusal = f"it speaks KV protocol version {version}, this worker {PROTOCOL_VERSION}"
    elif key is None and client_flags & _PROOF_GIVEN:
        refusal = f"it proves a cluster token and this worker has none: {SAME_TOKEN_HINT}"
    elif key is not None and not client_flags & _PROOF_GIVEN:
        refusal = (
            f"it did not prove it belongs to this cluster (it has no token): {SAME_TOKEN_HINT}"
        )
    elif key is not None and not proves(key, b"client", server_nonce, client_nonce, client_proof):
        refusal = f"it did not prove it belongs to this cluster (another token): {SAME_TOKEN_HINT}"
    if refusal is not None:
        connection.sendall(_HEAD.pack(_VERDICT, PROTOCOL_VERSION, 0) + _NO_PROOF)
        raise HandshakeRefused(refusal)
    verdict_flags, server_proof = _ACCEPTED, _NO_PROOF
    if key is not None:
        verdict_flags |= _SERVER_PROOF
        server_proof = proof(key, b"server", client_nonce, server_nonce)
    connection.sendall(_HEAD.pack(_VERDICT, PROTOCOL_VERSION, verdict_flags) + server_proof)


def open_handshake(
    connection: socket.socket, key: bytes | None, peer: tuple[str, int], deadline: float
) -> None:
    """Client side, right after connect: answer the server's HELLO and check its VERDICT, all
    by `deadline`. Raises KVTransferError when the peer is not a KV server, is refused or
    refuses us, or stays silent ("timeout"); the socket's OSError when the connection broke."""
    where = f"the KV server at {peer[0]}:{peer[1]}"
    try:
        magic = _recv_exactly(connection, len(_HELLO), deadline)  # a stranger fails here
        if magic != _HELLO:
            raise KVTransferError(
                "connection", f"{peer[0]}:{peer[1]} is not a tandem KV server: it sent {magic!r}"
            )
        hello = magic + _recv_exactly(connection, _HELLO_BYTES - len(magic), deadline)
        _, version, flags = _HEAD.unpack_from(hello)
        if version != PROTOCOL_VERSION:
            raise KVTransferError(
                "connection",
                f"{where} speaks KV protocol version {version}, this worker {PROTOCOL_VERSION}: "
                "run the same tandem version on both",
            )
        server_nonce = hello[_HEAD.size :]
        client_nonce = os.urandom(NONCE_BYTES)
        client_flags, client_proof = 0, _NO_PROOF
        if key is not None:
            client_flags, client_proof = (
                _PROOF_GIVEN,
                proof(key, b"client", server_nonce, client_nonce),
            )
        connection.settimeout(max(deadline - time.monotonic(), 1e-3))
        connection.sendall(
            _HEAD.pack(_AUTH, PROTOCOL_VERSION, client_flags) + client_nonce + client_proof
        )
        verdict = _recv_exactly(connection, _VERDICT_BYTES, deadline)
    except TimeoutError as exc:
        raise KVTransferError(
            "timeout",
            f"{where} did not finish the KV handshake in time (is that port a tandem KV server?)",
        ) from exc
    magic, _, verdict_flags = _HEAD.unpack_from(verdict)
    if magic != _VERDICT:
        raise KVTransferError("connection", f"{where} answered the handshake with {verdict!r}")
    if not verdict_flags & _ACCEPTED:
        if key is None:
            reason = f"it wants a cluster token and this worker has none: {SAME_TOKEN_HINT}"
        elif not flags & _PROOF_WANTED:
            reason = f"it has no cluster token and this worker has one: {SAME_TOKEN_HINT}"
        else:
            reason = f"this worker's cluster token is not the server's: {SAME_TOKEN_HINT}"
        raise KVTransferError("connection", f"{where} refused this worker: {reason}")
    server_proof = verdict[_HEAD.size :]
    if key is not None and not (
        verdict_flags & _SERVER_PROOF
        and proves(key, b"server", client_nonce, server_nonce, server_proof)
    ):
        raise KVTransferError(
            "connection", f"{where} did not prove it belongs to this cluster: {SAME_TOKEN_HINT}"
        )


def _recv_exactly(connection: socket.socket, count: int, deadline: float) -> bytes:
    """`count` bytes by `deadline` (TimeoutError after it); ConnectionError if the peer closes."""
    data = bytearray()
    while len(data) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the handshake's time passed")
        connection.settimeout(remaining)
        chunk = connection.recv(count - len(data))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(data)} bytes")
        data += chunk
    return bytes(data)
