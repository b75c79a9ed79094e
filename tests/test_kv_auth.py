"""The KV port's handshake (`tandem.kv.control.auth`), with real sockets: a client without the
cluster token gets nothing done (no fetch, no release, no announcement taken), a mismatch of tokens
fails clearly on both sides, a decode worker refuses a server that cannot prove the token
before any KV byte lands, a peer that is not a KV server fails within its tries of the handshake
timeout, a handshake whose reply was lost is tried again, and the connector passes its token to
both ends and counts its retries."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from fault_plugins.transport_faults import TransportFault, faulty
from kv_wire import (
    AWAIT,
    FETCH,
    HANDSHAKE_HEAD,
    HELLO_BYTES,
    VERSION,
    DoneRecorder,
    assert_same_layers,
    kv_key,
    mac,
    make_layers,
    message,
    raw_handshake,
    recv_exact,
    zeros_like_all,
)
from tandem.kv.config import KVTransferConfig
from tandem.kv.control import server as kv_server
from tandem.kv.control.auth import (
    HANDSHAKE_TIMEOUT_S,
    HandshakeError,
    derive_kv_key,
    proof,
    proves,
)
from tandem.kv.control.client import RETRY_ATTEMPTS, KVClient
from tandem.kv.control.plane import ControlPlane
from tandem.kv.control.server import KVServer
from tandem.kv.errors import KVTransferError

TOKEN = "the-cluster-token"
FIX = "give both workers the same --cluster-token"
LOGGER = "tandem.kv.control.server"


@pytest.fixture
def make_server() -> Iterator[Callable[..., tuple[KVServer, DoneRecorder]]]:
    servers: list[KVServer] = []

    def make(token: str | None = TOKEN, **kwargs: object) -> tuple[KVServer, DoneRecorder]:
        recorder = DoneRecorder()
        server = KVServer("127.0.0.1", 0, on_transfer_done=recorder, cluster_token=token, **kwargs)
        servers.append(server)
        return server, recorder

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def make_client() -> Iterator[Callable[..., KVClient]]:
    clients: list[KVClient] = []

    def make(token: str | None = TOKEN, **kwargs: object) -> KVClient:
        client = KVClient(cluster_token=token, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_the_key_and_proofs_are_hmac_sha256():
    assert derive_kv_key(TOKEN) == kv_key(TOKEN)
    assert derive_kv_key(None) is None
    key, first, second = kv_key(TOKEN), os.urandom(32), os.urandom(32)
    assert proof(key, b"client", first, second) == mac(key, b"client", first, second)
    assert proves(key, b"server", first, second, mac(key, b"server", first, second))
    assert not proves(key, b"server", first, second, mac(key, b"client", first, second))
    assert not proves(
        kv_key("another"), b"server", first, second, mac(key, b"server", first, second)
    )


def test_the_config_carries_the_token_without_showing_it():
    config = KVTransferConfig(role="decode", cluster_token=TOKEN)
    assert config.cluster_token == TOKEN and TOKEN not in repr(config)
    assert KVTransferConfig(role="decode").cluster_token is None


def everything_until_closed(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (fails if it keeps it open)."""
    data = bytearray()
    sock.settimeout(5.0)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def fetch_request(transfer_id: str, layers: list[torch.Tensor], release_only: bool) -> bytes:
    nbytes = [t.numel() * t.element_size() for t in layers]
    payload = {"transfer_id": transfer_id, "layer_nbytes": nbytes, "release_only": release_only}
    return message(FETCH, msgspec.msgpack.encode(payload))


@pytest.mark.parametrize("request_kind", ["fetch", "release_only", "await"])
@pytest.mark.parametrize("approach", ["no handshake", "no proof", "forged proof"])
def test_a_client_without_the_token_gets_nothing_done(
    make_server, make_client, request_kind, approach
):
    """A raw client asks for a transfer's bytes, releases its lease, or claims a handoff's
    announcement: skipping the handshake, or without a proof, or with a made-up one. The
    server closes the connection having sent only its HELLO (and a refusal); the transfer stays
    published and the announcement waiting, for the decode that proves the token."""
    server, done = make_server(handshake_timeout=0.5)
    layers = make_layers(seed=20, num_layers=3)
    server.publish("t", layers)
    announcement = {"remote_request_id": "t", "first_token_id": 5}
    server.announce("h", announcement)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5.0)
    if approach == "no handshake":
        expected = HELLO_BYTES
    else:
        raw_handshake(sock, proof=None if approach == "no proof" else os.urandom(32))
        expected = 0  # read by raw_handshake: HELLO, then the refusal
    if request_kind == "await":
        payload = msgspec.msgpack.encode({"handoff_id": "h", "timeout_s": 5.0})
        sock.sendall(message(AWAIT, payload))
    else:
        sock.sendall(fetch_request("t", layers, release_only=request_kind == "release_only"))
    assert len(everything_until_closed(sock)) == expected
    sock.close()

    client = make_client()
    assert client.await_announcement("127.0.0.1", server.port, "h", timeout=5) == announcement
    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "t", dest, timeout=5)
    assert_same_layers(dest, layers)
    assert done.wait_for(1) == [("t", True)]


def test_a_refused_handshake_answers_no_and_an_accepted_one_proves_the_server(make_server):
    server, _ = make_server()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as sock:
        assert raw_handshake(sock, token=TOKEN) == (1, 3)  # proof wanted; accepted + proof
    with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as sock:
        assert raw_handshake(sock, token="another") == (1, 0)
    open_server, _ = make_server(token=None)
    with socket.create_connection(("127.0.0.1", open_server.port), timeout=5.0) as sock:
        assert raw_handshake(sock) == (0, 1)


@pytest.mark.parametrize(
    ("server_token", "client_token", "client_says"),
    [
        (TOKEN, "another", "this worker's cluster token is not the server's"),
        (TOKEN, None, "it wants a cluster token and this worker has none"),
        (None, TOKEN, "it has no cluster token and this worker has one"),
    ],
)
def test_a_token_mismatch_fails_clearly_on_both_sides(
    make_server, make_client, caplog, server_token, client_token, client_says
):
    server, done = make_server(token=server_token)
    layers = make_layers(seed=21, num_layers=2)
    server.publish("t", layers)
    retries: list[None] = []
    client = make_client(token=client_token, on_retry=lambda: retries.append(None))
    dest = zeros_like_all(layers)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(KVTransferError) as error:
            client.fetch("127.0.0.1", server.port, "t", dest, timeout=600)
        deadline = time.monotonic() + 5.0
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    assert error.value.kind == "connection"
    assert str(error.value) == (
        f"connection: the KV server at 127.0.0.1:{server.port} refused this worker: "
        f"{client_says}: {FIX}"
    )
    assert time.monotonic() - started < 2.0 and retries == []  # not tried again
    [record] = caplog.records
    assert "refused a client" in record.getMessage() and FIX in record.getMessage()
    assert all(not layer.any() for layer in dest) and done.calls == []


def play_a_server(hello_flags: int, verdict: Callable[[bytes, bytes], bytes], layers) -> tuple:
    """A fake KV server on a free port: HELLO, then the VERDICT that verdict(server nonce,
    client nonce) makes, then the layers right away (as if asked) with its own bytes. Returns
    (port, thread, what it read after the AUTH)."""
    listener = socket.create_server(("127.0.0.1", 0))
    after_auth: list[bytes] = []

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            server_nonce = os.urandom(32)
            connection.sendall(HANDSHAKE_HEAD.pack(b"TKVH", VERSION, hello_flags) + server_nonce)
            auth = recv_exact(connection, HANDSHAKE_HEAD.size + 64)
            client_nonce = auth[HANDSHAKE_HEAD.size : HANDSHAKE_HEAD.size + 32]
            try:
                connection.sendall(verdict(server_nonce, client_nonce))
                for index, layer in enumerate(layers):
                    poison = torch.full_like(layer, 7).reshape(-1).view(torch.uint8)
                    connection.sendall(message(2, poison.numpy().tobytes(), layer=index))
            except OSError:
                pass  # the client left
            after_auth.append(everything_until_closed(connection))

    thread = threading.Thread(target=serve)
    thread.start()
    return listener.getsockname()[1], thread, after_auth


@pytest.mark.parametrize("impostor", ["no token", "another token", "no proof"])
def test_a_server_that_cannot_prove_the_token_is_refused_before_any_byte_lands(
    make_client, impostor
):
    """A "prefill" server that accepts the decode worker without proving the token (it has
    none, or another, or sends no proof), then pushes its own KV: the decode worker stops at
    the handshake; no byte reaches the destination and no request reaches the server."""
    layers = make_layers(seed=22, num_layers=2)
    head = HANDSHAKE_HEAD.pack

    def verdict(server_nonce: bytes, client_nonce: bytes) -> bytes:
        if impostor == "no token":
            return head(b"TKVV", VERSION, 1) + bytes(32)
        if impostor == "no proof":
            return head(b"TKVV", VERSION, 1) + os.urandom(32)
        forged = mac(kv_key("another"), b"server", client_nonce, server_nonce)
        return head(b"TKVV", VERSION, 3) + forged

    port, thread, after_auth = play_a_server(0 if impostor == "no token" else 1, verdict, layers)
    dest = zeros_like_all(layers)
    with pytest.raises(KVTransferError) as error:
        make_client().fetch("127.0.0.1", port, "t", dest, timeout=600)
    thread.join(10.0)
    assert str(error.value) == (
        f"connection: the KV server at 127.0.0.1:{port} did not prove it belongs to this "
        f"cluster: {FIX}"
    )
    assert all(not layer.any() for layer in dest)
    assert after_auth == [b""]  # no FETCH, nothing at all after the AUTH


def test_a_real_server_with_another_token_gets_no_request(make_server, make_client):
    server, done = make_server(token="another")
    layers = make_layers(seed=23, num_layers=2)
    server.publish("t", layers)
    server.announce("h", {"n": 1})
    client = make_client()
    dest = zeros_like_all(layers)
    for call in (
        lambda: client.fetch("127.0.0.1", server.port, "t", dest, timeout=600),
        lambda: client.await_announcement("127.0.0.1", server.port, "h", timeout=600),
    ):
        with pytest.raises(KVTransferError) as error:
            call()
        assert error.value.kind == "connection" and FIX in str(error.value)
    assert all(not layer.any() for layer in dest) and done.calls == []
    assert make_client(token="another").await_announcement(
        "127.0.0.1", server.port, "h", timeout=5
    ) == {"n": 1}


def a_peer(kind: str) -> tuple[int, Callable[[], None]]:
    """A listening port that accepts and stays silent, or answers as an HTTP server would;
    returns the port and a function that shuts it."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(connection)
            if kind == "http":
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve)
    thread.start()

    def shut() -> None:
        stop.set()
        thread.join(5.0)
        for connection in [*accepted, listener]:
            connection.close()

    return listener.getsockname()[1], shut


@pytest.mark.parametrize("call", ["fetch", "await"])
@pytest.mark.parametrize("peer", ["silent", "http"])
def test_a_port_that_is_not_a_kv_server_fails_within_the_handshake_timeout(make_client, peer, call):
    """Pointed at a port that accepts and says nothing, or that speaks HTTP, a fetch or a
    handoff's wait with a 600 s deadline fails typed: the silent one once each try has waited
    the handshake timeout, the HTTP one at once."""
    port, shut = a_peer(peer)
    client = make_client(token=None, handshake_timeout=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(KVTransferError) as error:
            if call == "fetch":
                client.fetch("127.0.0.1", port, "t", [torch.zeros(4)], timeout=600)
            else:
                client.await_announcement("127.0.0.1", port, "h", timeout=600)
    finally:
        shut()
    elapsed = time.monotonic() - started
    if peer == "silent":
        assert RETRY_ATTEMPTS * 0.5 <= elapsed < RETRY_ATTEMPTS * 0.5 + 1.5
        assert error.value.kind == "timeout"
    else:
        assert elapsed < 1.0
        assert str(error.value) == (
            f"connection: 127.0.0.1:{port} is not a tandem KV server: it sent b'HTTP'"
        )


def test_the_default_handshake_timeout_bounds_a_600_s_fetch(make_client):
    port, shut = a_peer("silent")
    started = time.monotonic()
    try:
        with pytest.raises(KVTransferError) as error:  # one try: its timeout is the default's
            client = make_client(retry_attempts=1)
            client.fetch("127.0.0.1", port, "t", [torch.zeros(4)], timeout=600)
    finally:
        shut()
    assert error.value.kind == "timeout"
    assert HANDSHAKE_TIMEOUT_S - 0.1 < time.monotonic() - started < HANDSHAKE_TIMEOUT_S + 2.0


def test_the_server_drops_a_client_silent_in_the_handshake(make_server):
    server, _ = make_server(handshake_timeout=0.3)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as sock:
        started = time.monotonic()
        assert len(everything_until_closed(sock)) == HELLO_BYTES
        assert time.monotonic() - started < 2.0


def test_a_pooled_connection_is_authenticated_once(make_server, make_client, monkeypatch):
    handshakes: list[None] = []
    serve_handshake = kv_server.serve_handshake

    def counting(*args, **kwargs):
        handshakes.append(None)
        return serve_handshake(*args, **kwargs)

    monkeypatch.setattr(kv_server, "serve_handshake", counting)
    server, done = make_server()
    client = make_client()
    for index in range(3):
        layers = make_layers(seed=30 + index, num_layers=2)
        server.publish(f"t{index}", layers)
        dest = zeros_like_all(layers)
        client.fetch("127.0.0.1", server.port, f"t{index}", dest, timeout=5)
        assert_same_layers(dest, layers)
    assert len(handshakes) == 1 and server.connections_accepted == 1


def test_a_handshake_whose_reply_is_lost_is_tried_again(make_server, make_client, monkeypatch):
    """The server's HELLO on the first connection never reaches the client (the server stays
    silent on it until the client has come again): the client gives that connection up after
    the handshake timeout and fetches on a new one."""
    handshakes: list[socket.socket] = []
    came_again = threading.Event()
    serve_handshake = kv_server.serve_handshake

    def first_reply_lost(connection, *args, **kwargs):
        handshakes.append(connection)
        if len(handshakes) == 1:
            came_again.wait(10.0)
            raise HandshakeError("its HELLO was lost")
        came_again.set()
        return serve_handshake(connection, *args, **kwargs)

    monkeypatch.setattr(kv_server, "serve_handshake", first_reply_lost)
    server, done = make_server()
    retries: list[None] = []
    client = make_client(handshake_timeout=2.0, on_retry=lambda: retries.append(None))
    layers = make_layers(seed=40, num_layers=2)
    server.publish("t", layers)
    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "t", dest, timeout=5)
    assert_same_layers(dest, layers)
    assert len(handshakes) == 2 and len(retries) == 1
    assert done.wait_for(1) == [("t", True)]


def test_the_control_plane_gives_both_ends_its_token_and_counts_retries(monkeypatch):
    """A prefill engine's KV server wants its token; a decode engine's client proves its own
    and counts the tries after a broken connection in kv_transfer_failures ("retried")."""
    fault = TransportFault(drop_after_layers=1, times=1)
    monkeypatch.setattr(kv_server, "KVServer", faulty(kv_server.KVServer, fault))
    prefill = ControlPlane(KVTransferConfig(role="prefill", cluster_token=TOKEN))
    decode = ControlPlane(KVTransferConfig(role="decode", cluster_token=TOKEN))
    stranger = KVClient()
    try:
        layers = make_layers(seed=40, num_layers=3)
        prefill.server.publish("t", layers)
        with pytest.raises(KVTransferError) as error:
            stranger.fetch("127.0.0.1", prefill.server.port, "t", zeros_like_all(layers), timeout=5)
        assert FIX in str(error.value)
        dest = zeros_like_all(layers)
        decode.client.fetch("127.0.0.1", prefill.server.port, "t", dest, timeout=5)
        assert_same_layers(dest, layers)
        assert decode.stats()["kv_transfer_failures"] == {"retried": 1}
        assert prefill.stats()["kv_transfer_failures"] == {"send": 1}
    finally:
        stranger.close()
        decode.close()
        prefill.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_worker_on_every_address_must_be_told_the_kv_address_it_advertises(host):
    from tandem.cli import build_parser
    from tandem.server.main import kv_config_from_args

    def kv_config(*flags: str) -> KVTransferConfig:
        args = build_parser().parse_args(["worker", "--role", "prefill", "--host", host, *flags])
        return kv_config_from_args(args)

    with pytest.raises(SystemExit, match="pass --kv-host with the address peers reach"):
        kv_config()
    assert kv_config("--kv-host", "10.1.2.3").host == "10.1.2.3"


def test_a_worker_on_every_address_must_be_told_the_url_it_gives_its_router():
    from tandem.cli import build_parser
    from tandem.server.main import advertised_url

    def url(*flags: str) -> str:
        args = build_parser().parse_args(["worker", "--host", "0.0.0.0", *flags])
        return advertised_url(args, "http://0.0.0.0:8100")

    assert url() == "http://0.0.0.0:8100"  # no router: nothing is advertised
    with pytest.raises(SystemExit, match="pass --advertise-url"):
        url("--router", "http://10.0.0.1:8000")
    given = "http://10.1.2.3:8100"
    assert url("--router", "http://10.0.0.1:8000", "--advertise-url", given) == given
