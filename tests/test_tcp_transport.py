"""Tests of the TCP KV transport: bytes, layer pacing, every failure path, concurrency, and a
transfer between two network namespaces joined by a veth pair."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

import tandem
from fault_plugins.transport_faults import TransportFault, faulty
from kv_wire import (
    CONFIRM,
    FETCH,
    LAYER,
    WIRE_HEADER,
    DoneRecorder,
    assert_same_layers,
    closed_by_server,
    layer_bytes,
    make_layers,
    raw_connect,
    recv_exact,
    zeros_like_all,
)
from tandem.kv.control import wire
from tandem.kv.control.client import RETRY_ATTEMPTS, KVClient
from tandem.kv.control.server import KVServer
from tandem.kv.errors import KVTransferError


@pytest.fixture
def make_server() -> Iterator[Callable[..., tuple[KVServer, DoneRecorder]]]:
    """A server on a free port (with `fault`: one that injects it) and its done recorder."""
    servers: list[KVServer] = []

    def make(fault: TransportFault | None = None, **kwargs: object):
        recorder = DoneRecorder()
        server_class = KVServer if fault is None else faulty(KVServer, fault)
        server = server_class("127.0.0.1", 0, on_transfer_done=recorder, **kwargs)
        servers.append(server)
        return server, recorder

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def client() -> Iterator[KVClient]:
    kv_client = KVClient()
    yield kv_client
    kv_client.close()


def fetch_in_thread(
    client: KVClient, port: int, transfer_id: str, dest: list[torch.Tensor], **kwargs: object
) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            client.fetch("127.0.0.1", port, transfer_id, dest, **kwargs)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def raw_fetch_request(transfer_id: str, layers: list[torch.Tensor]) -> bytes:
    payload = msgspec.msgpack.encode(
        {"transfer_id": transfer_id, "layer_nbytes": [t.numel() * t.element_size() for t in layers]}
    )
    return WIRE_HEADER.pack(b"TKV1", FETCH, 0, len(payload)) + payload


def test_round_trip_float32_and_bfloat16(make_server, client):
    server, done = make_server()
    layers = make_layers(seed=0, num_layers=6)
    layers.append(torch.arange(-50, 50, dtype=torch.int8))
    server.publish("req-1", layers)
    dest = zeros_like_all(layers)
    arrived: list[int] = []

    client.fetch("127.0.0.1", server.port, "req-1", dest, timeout=10.0, on_layer=arrived.append)

    assert arrived == list(range(len(layers)))
    assert_same_layers(dest, layers)
    assert done.wait_for(1) == [("req-1", True)]
    with pytest.raises(KVTransferError) as info:
        client.fetch("127.0.0.1", server.port, "req-1", dest, timeout=5.0)
    assert info.value.kind == "not_found"


def test_layer_is_sent_only_after_wait_layer_returns(make_server, client):
    server, done = make_server()
    expected = make_layers(seed=1, num_layers=3)
    staging = [expected[0].clone(), torch.zeros_like(expected[1]), torch.zeros_like(expected[2])]
    layer_one_waiting = threading.Event()
    release_layer_one = threading.Event()

    def wait_layer(index: int) -> None:
        if index == 1:
            layer_one_waiting.set()
            assert release_layer_one.wait(10.0)
        if index > 0:
            staging[index].copy_(expected[index])  # the bytes become valid only now

    arrival_times: dict[int, float] = {}
    layer_zero_arrived = threading.Event()

    def on_layer(index: int) -> None:
        arrival_times[index] = time.monotonic()
        if index == 0:
            layer_zero_arrived.set()

    server.publish("req-paced", staging, wait_layer=wait_layer)
    dest = zeros_like_all(expected)
    thread, errors = fetch_in_thread(
        client, server.port, "req-paced", dest, timeout=10.0, on_layer=on_layer
    )
    assert layer_zero_arrived.wait(5.0)
    assert layer_one_waiting.wait(5.0)
    time.sleep(0.2)
    assert sorted(arrival_times) == [0], "layer 1 went out before wait_layer(1) returned"
    released_at = time.monotonic()
    release_layer_one.set()
    thread.join(10.0)

    assert errors == []
    assert sorted(arrival_times) == [0, 1, 2]
    assert arrival_times[0] < released_at < arrival_times[1] < arrival_times[2]
    assert_same_layers(dest, expected)
    assert done.wait_for(1) == [("req-paced", True)]


def test_unknown_id_is_not_found_and_the_connection_is_reused(make_server, client):
    server, done = make_server()
    layers = make_layers(seed=2, num_layers=2)
    with pytest.raises(KVTransferError) as info:
        client.fetch("127.0.0.1", server.port, "never-published", layers, timeout=5.0)
    assert info.value.kind == "not_found"

    server.publish("req-2", layers)
    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-2", dest, timeout=5.0)
    assert_same_layers(dest, layers)
    assert done.wait_for(1) == [("req-2", True)]
    assert server.connections_accepted == 1


def test_size_mismatch_is_reported_and_the_transfer_stays(make_server, client):
    server, done = make_server()
    layers = make_layers(seed=3, num_layers=2)
    server.publish("req-3", layers)
    wrong = [torch.zeros(2, 4, 16, 3, 64), torch.zeros_like(layers[1])]
    with pytest.raises(KVTransferError) as info:
        client.fetch("127.0.0.1", server.port, "req-3", wrong, timeout=5.0)
    assert info.value.kind == "mismatch"
    assert done.calls == [("req-3", False)]

    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-3", dest, timeout=5.0)
    assert_same_layers(dest, layers)
    assert done.wait_for(2) == [("req-3", False), ("req-3", True)]


def test_withdraw_during_fetch_aborts(make_server, client):
    server, done = make_server()
    layers = make_layers(seed=4, num_layers=3)
    release = threading.Event()
    server.publish("req-4", layers, wait_layer=lambda index: index == 0 or release.wait(10.0))
    layer_zero = threading.Event()
    dest = zeros_like_all(layers)
    thread, errors = fetch_in_thread(
        client, server.port, "req-4", dest, timeout=10.0, on_layer=lambda i: layer_zero.set()
    )
    assert layer_zero.wait(5.0)
    server.withdraw("req-4")
    release.set()
    thread.join(10.0)

    assert len(errors) == 1 and isinstance(errors[0], KVTransferError)
    assert errors[0].kind == "aborted"
    assert done.wait_for(1, timeout=0.2) == [], "a withdrawn transfer gets no callback"
    server.withdraw("req-4")  # withdrawing twice is a no-op


def test_failing_wait_layer_aborts_and_reports_failure(make_server, client):
    server, done = make_server()
    layers = make_layers(seed=5, num_layers=2)

    def wait_layer(index: int) -> None:
        if index == 1:
            raise RuntimeError("copy failed")

    server.publish("req-5", layers, wait_layer=wait_layer)
    with pytest.raises(KVTransferError) as info:
        client.fetch("127.0.0.1", server.port, "req-5", zeros_like_all(layers), timeout=5.0)
    assert info.value.kind == "aborted"
    assert done.wait_for(1) == [("req-5", False)]


class RetryCounter:
    """on_retry for a client: counts the tries after a broken connection."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@pytest.fixture
def retrying_client() -> Iterator[tuple[KVClient, RetryCounter]]:
    retries = RetryCounter()
    kv_client = KVClient(on_retry=retries)
    yield kv_client, retries
    kv_client.close()


@pytest.mark.parametrize("drop_after_layers", [0, 1, 3])
def test_a_fetch_whose_connection_drops_once_is_retried(
    make_server, retrying_client, drop_after_layers
):
    """The server drops the connection after 0, 1 or all 3 layers (before CONFIRM): the fetch
    goes on on a new connection and delivers the same bytes, each layer reported once; the
    transfer stays published meanwhile and is confirmed once (after all 3: a confirmation
    without the bytes, which are in already)."""
    client, retries = retrying_client
    server, done = make_server(fault=TransportFault(drop_after_layers=drop_after_layers, times=1))
    layers = make_layers(seed=6, num_layers=3)
    server.publish("req-6", layers)
    arrived: list[int] = []
    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-6", dest, timeout=600, on_layer=arrived.append)

    assert arrived == [0, 1, 2]
    assert_same_layers(dest, layers)
    assert done.wait_for(2) == [("req-6", False), ("req-6", True)]
    assert retries.count == 1 and server.connections_accepted == 2


def test_a_fetch_that_breaks_more_often_than_its_retries_fails(make_server, retrying_client):
    """Every connection drops after a layer: RETRY_ATTEMPTS tries, then the typed error; the
    transfer stays published (each break reported) and a fetch on a sound server side works."""
    client, retries = retrying_client
    server, done = make_server(fault=TransportFault(drop_after_layers=1, times=RETRY_ATTEMPTS))
    layers = make_layers(seed=13, num_layers=3)
    server.publish("req-13", layers)
    started = time.monotonic()
    with pytest.raises(KVTransferError) as info:
        client.fetch("127.0.0.1", server.port, "req-13", zeros_like_all(layers), timeout=600)
    assert info.value.kind == "connection"
    assert time.monotonic() - started < 2.0
    assert retries.count == RETRY_ATTEMPTS - 1
    assert done.wait_for(RETRY_ATTEMPTS) == [("req-13", False)] * RETRY_ATTEMPTS

    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-13", dest, timeout=5.0)
    assert_same_layers(dest, layers)
    assert done.wait_for(RETRY_ATTEMPTS + 1)[-1] == ("req-13", True)


def test_a_release_whose_answer_is_lost_is_done(make_server, retrying_client):
    """The server drops the connection after a release, before its answer: the retry finds the
    transfer gone, which is what the release asked for."""
    client, retries = retrying_client
    server, done = make_server()
    server.publish("t", make_layers(14, num_layers=2))
    original = server._finish

    def finish_then_drop(connection, transfer_id, transfer):
        with server._lock:
            del server._transfers[transfer_id]
        server._call_done(transfer_id, True)
        connection.shutdown(socket.SHUT_RDWR)  # DONE never goes out

    server._finish = finish_then_drop
    client.release("127.0.0.1", server.port, "t", timeout=5.0)
    server._finish = original
    assert done.calls == [("t", True)] and retries.count == 1


def test_delay_past_the_client_deadline_is_a_timeout(make_server, client):
    server, done = make_server(fault=TransportFault.parse("delay:5,times:1"))
    layers = make_layers(seed=7, num_layers=2)
    server.publish("req-7", layers)
    started = time.monotonic()
    with pytest.raises(KVTransferError) as info:
        client.fetch("127.0.0.1", server.port, "req-7", zeros_like_all(layers), timeout=0.3)
    assert info.value.kind == "timeout"
    assert time.monotonic() - started < 2.0

    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-7", dest, timeout=5.0)
    assert_same_layers(dest, layers)
    assert done.wait_for(1) == [("req-7", True)]


@pytest.mark.parametrize("handshake", [False, True])
def test_garbage_and_silent_clients_leave_the_server_serving(make_server, client, handshake):
    """Garbage in place of the handshake, or after it: the server drops that connection only."""
    server, done = make_server()
    layers = make_layers(seed=8, num_layers=2)
    server.publish("req-8", layers)
    silent = raw_connect(server.port, handshake=handshake)
    garbage_messages = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(64),
        WIRE_HEADER.pack(b"TKV1", FETCH, 0, 1 << 40),  # absurd control length
        WIRE_HEADER.pack(b"TKV1", FETCH, 0, 3) + b"\xc1\xc1\xc1",  # not msgpack
        WIRE_HEADER.pack(b"TKV1", CONFIRM, 0, 0),  # out of order
    ]
    for message in garbage_messages:
        sock = raw_connect(server.port, handshake=handshake)
        sock.sendall(message.ljust(72, b"\0"))  # at least an AUTH's length
        assert closed_by_server(sock), f"the server kept a connection that sent {message!r}"
        sock.close()

    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-8", dest, timeout=5.0)
    assert_same_layers(dest, layers)
    assert done.wait_for(1) == [("req-8", True)]
    silent.close()


def test_client_dropping_mid_transfer_reports_failure_and_keeps_the_transfer(make_server, client):
    server, done = make_server()
    layers = make_layers(seed=9, num_layers=4, num_blocks=64)  # 1.5 MB float32 layers
    server.publish("req-9", layers)
    sock = raw_connect(server.port)
    sock.sendall(raw_fetch_request("req-9", layers))
    magic, message_type, layer, length = WIRE_HEADER.unpack(recv_exact(sock, WIRE_HEADER.size))
    assert (magic, message_type, layer) == (b"TKV1", LAYER, 0)
    assert length == layers[0].numel() * 4
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # reset mid-transfer
    assert done.wait_for(1) == [("req-9", False)]

    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-9", dest, timeout=5.0)
    assert_same_layers(dest, layers)
    assert done.wait_for(2) == [("req-9", False), ("req-9", True)]


def test_client_that_never_confirms_times_out_on_the_server(make_server, client):
    server, done = make_server(io_timeout=0.3)
    layers = make_layers(seed=10, num_layers=2)
    server.publish("req-10", layers)
    sock = raw_connect(server.port)
    sock.sendall(raw_fetch_request("req-10", layers))
    for index, layer in enumerate(layers):
        _, message_type, layer_index, length = WIRE_HEADER.unpack(
            recv_exact(sock, WIRE_HEADER.size)
        )
        assert (message_type, layer_index) == (LAYER, index)
        assert recv_exact(sock, length) == layer_bytes(layer)
    assert done.wait_for(1) == [("req-10", False)]
    assert closed_by_server(sock)
    sock.close()

    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-10", dest, timeout=5.0)
    assert_same_layers(dest, layers)


def test_sixteen_concurrent_fetches(make_server, client):
    server, done = make_server()
    transfers = {
        f"req-c{i}": make_layers(seed=100 + i, num_layers=3, num_blocks=16) for i in range(16)
    }
    for transfer_id, layers in transfers.items():
        server.publish(transfer_id, layers)
    dests = {transfer_id: zeros_like_all(layers) for transfer_id, layers in transfers.items()}
    started = [fetch_in_thread(client, server.port, tid, dests[tid], timeout=20.0) for tid in dests]
    for thread, _ in started:
        thread.join(20.0)

    assert [errors for _, errors in started] == [[]] * 16
    for transfer_id, layers in transfers.items():
        assert_same_layers(dests[transfer_id], layers)
    assert sorted(done.wait_for(16)) == sorted((tid, True) for tid in transfers)


def test_a_stale_pooled_connection_is_replaced(make_server, client):
    server, done = make_server(idle_timeout=0.2)
    layers = make_layers(seed=11, num_layers=2)
    server.publish("req-11a", layers)
    client.fetch("127.0.0.1", server.port, "req-11a", zeros_like_all(layers), timeout=5.0)
    time.sleep(0.6)  # the server closes the idle pooled connection meanwhile
    server.publish("req-11b", layers)
    dest = zeros_like_all(layers)
    client.fetch("127.0.0.1", server.port, "req-11b", dest, timeout=5.0)
    assert_same_layers(dest, layers)
    assert server.connections_accepted == 2
    assert done.wait_for(2) == [("req-11a", True), ("req-11b", True)]


def test_unreachable_server_is_a_connection_error(client):
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        free_port = placeholder.getsockname()[1]
    with pytest.raises(KVTransferError) as info:
        client.fetch("127.0.0.1", free_port, "x", [torch.zeros(4)], timeout=2.0)
    assert info.value.kind == "connection"


def test_transport_fault_parse():
    assert TransportFault.parse("drop:1") == TransportFault(drop_after_layers=1)
    assert TransportFault.parse("delay:5") == TransportFault(delay_s=5.0)
    assert TransportFault.parse("delay:0.5, drop:0, times:2") == TransportFault(
        drop_after_layers=0, delay_s=0.5, times=2
    )
    for bad in ["", "drop", "drop:x", "explode:1", "drop:-1", "times:0"]:
        with pytest.raises(ValueError):
            TransportFault.parse(bad)


SERVER_SCRIPT = textwrap.dedent(
    """
    import sys, threading, torch
    from tandem.kv.control.server import KVServer
    layers = torch.load(sys.argv[2])
    done = threading.Event()
    results = []
    def on_done(transfer_id, ok):
        results.append((transfer_id, ok))
        done.set()
    server = KVServer(sys.argv[1], 0, on_transfer_done=on_done)
    server.publish("netns-transfer", layers)
    print(server.port, flush=True)
    done.wait(30)
    server.close()
    print(results, flush=True)
    """
)

CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from tandem.kv.control.client import KVClient
    dest = [torch.zeros_like(layer) for layer in torch.load(sys.argv[3])]
    client = KVClient()
    client.fetch(sys.argv[1], int(sys.argv[2]), "netns-transfer", dest, timeout=30)
    client.close()
    torch.save(dest, sys.argv[4])
    """
)


def run_ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def test_fetch_between_network_namespaces(tmp_path: Path):
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    pid = os.getpid()
    server_ns, client_ns = f"tkv-srv-{pid}", f"tkv-cli-{pid}"
    server_if, client_if = f"tkvs{pid}", f"tkvc{pid}"
    server_address, client_address = "10.77.0.1", "10.77.0.2"
    created = run_ip("netns", "add", server_ns)
    if created.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here: {created.stderr.strip()}")
    try:
        for step in [
            ("netns", "add", client_ns),
            ("link", "add", server_if, "netns", server_ns, "type", "veth",
             "peer", "name", client_if, "netns", client_ns),
            ("-n", server_ns, "addr", "add", f"{server_address}/24", "dev", server_if),
            ("-n", client_ns, "addr", "add", f"{client_address}/24", "dev", client_if),
            ("-n", server_ns, "link", "set", server_if, "up"),
            ("-n", client_ns, "link", "set", client_if, "up"),
        ]:  # fmt: skip
            result = run_ip(*step)
            assert result.returncode == 0, f"ip {' '.join(step)}: {result.stderr}"

        layers = make_layers(seed=12, num_layers=4, num_blocks=32)
        source_file, dest_file = tmp_path / "source.pt", tmp_path / "dest.pt"
        torch.save(layers, source_file)
        env = {**os.environ, "PYTHONPATH": str(Path(tandem.__file__).parents[1])}
        server = subprocess.Popen(
            ["ip", "netns", "exec", server_ns, sys.executable, "-c", SERVER_SCRIPT,
             server_address, str(source_file)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            port_line = server.stdout.readline().strip()
            assert port_line.isdigit(), f"server failed: {port_line} {server.stderr.read()}"
            fetched = subprocess.run(
                ["ip", "netns", "exec", client_ns, sys.executable, "-c", CLIENT_SCRIPT,
                 server_address, port_line, str(source_file), str(dest_file)],
                capture_output=True, text=True, env=env, timeout=60,
            )  # fmt: skip
            assert fetched.returncode == 0, fetched.stderr
            server_out, server_err = server.communicate(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        assert server.returncode == 0, server_err
        assert server_out.strip() == "[('netns-transfer', True)]"
        received = torch.load(dest_file)
        assert_same_layers(received, layers)
    finally:
        for namespace in (server_ns, client_ns):
            run_ip("netns", "del", namespace)


def test_release_ends_a_transfer_without_its_bytes(make_server, client):
    server, done = make_server()
    server.publish("t", make_layers(3))
    client.release("127.0.0.1", server.port, "t", timeout=5)
    assert done.wait_for(1) == [("t", True)]
    for call in (
        lambda: client.fetch("127.0.0.1", server.port, "t", make_layers(3), timeout=5),
        lambda: client.release("127.0.0.1", server.port, "unknown", timeout=5),
    ):
        with pytest.raises(KVTransferError) as error:  # forgotten, as after a fetch
            call()
        assert error.value.kind == "not_found"


class HoldOwner:
    """on_transfer_held for a server: records the holds, and refuses the ids in `ended`."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.ended: set[str] = set()

    def __call__(self, transfer_id: str) -> bool:
        if transfer_id in self.ended:
            return False
        self.held.append(transfer_id)
        return True


def assert_release_ends_the_transfer(hold, server, client, done) -> None:
    """hold.release() confirms (on_transfer_done(id, True)) and the server forgets the transfer,
    as after a fetch; the connection went back to the pool and served the next request."""
    hold.release()
    assert done.wait_for(1) == [("gpu", True)]
    with pytest.raises(KVTransferError) as error:
        client.hold("127.0.0.1", server.port, "gpu", timeout=5).wait()
    assert error.value.kind == "not_found"
    assert server.connections_accepted == 1


def test_a_hold_keeps_a_transfer_until_its_release(make_server, client):
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("gpu", [])  # a GPU-direct transfer: the decode reads the blocks itself
    hold = client.hold("127.0.0.1", server.port, "gpu", timeout=5)
    hold.wait()
    assert owner.held == ["gpu"]
    assert done.calls == []  # held, not done: the transfer is still published
    assert_release_ends_the_transfer(hold, server, client, done)


def test_a_hold_the_owner_refuses_fails_and_the_connection_is_reused(make_server, client):
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("ended", [])
    owner.ended.add("ended")  # its lease ended between the publication and the hold
    hold = client.hold("127.0.0.1", server.port, "ended", timeout=5)
    with pytest.raises(KVTransferError) as error:
        hold.wait()
    assert error.value.kind == "aborted"
    with pytest.raises(KVTransferError):
        hold.release()  # nothing is held: nothing to confirm
    with pytest.raises(KVTransferError) as error:
        client.hold("127.0.0.1", server.port, "unknown", timeout=5).wait()
    assert error.value.kind == "not_found"
    server.publish("layers", make_layers(1))  # a transfer with layers cannot be held
    with pytest.raises(KVTransferError) as error:
        client.hold("127.0.0.1", server.port, "layers", timeout=5).wait()
    assert error.value.kind == "mismatch"
    assert done.calls == [("layers", False)] and owner.held == []
    assert server.connections_accepted == 1


def test_an_abandoned_hold_lets_go_and_a_new_one_can_follow(make_server, client):
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("gpu", [])
    hold = client.hold("127.0.0.1", server.port, "gpu", timeout=5)
    hold.wait()
    hold.abandon()  # the decode failed after the hold: the connection closes unconfirmed
    assert done.wait_for(1) == [("gpu", False)]  # the owner lets go; the transfer stays
    retry = client.hold("127.0.0.1", server.port, "gpu", timeout=5)
    retry.wait()
    retry.release()
    assert done.wait_for(2) == [("gpu", False), ("gpu", True)]
    assert owner.held == ["gpu", "gpu"]


@pytest.mark.parametrize("drops", [1, RETRY_ATTEMPTS])
def test_a_hold_whose_connection_drops_before_held_is_asked_again(
    make_server, retrying_client, drops
):
    """An injected drop comes before HELD: the hold is asked for again on a new connection
    and held there; with a drop on every try, it fails with the typed error."""
    client, retries = retrying_client
    owner = HoldOwner()
    fault = TransportFault(drop_after_layers=0, times=drops)
    server, done = make_server(on_transfer_held=owner, fault=fault)
    server.publish("gpu", [])
    hold = client.hold("127.0.0.1", server.port, "gpu", timeout=5)
    if drops == RETRY_ATTEMPTS:
        with pytest.raises(KVTransferError) as error:
            hold.wait()
        assert error.value.kind == "connection" and retries.count == RETRY_ATTEMPTS - 1
        assert done.wait_for(drops) == [("gpu", False)] * drops and owner.held == []
        return
    hold.wait()
    assert owner.held == ["gpu"] and retries.count == 1
    hold.release()
    assert done.wait_for(2) == [("gpu", False), ("gpu", True)]


def test_a_hold_broken_while_another_connection_holds_keeps_the_transfer_held(make_server, client):
    """A decode whose held connection broke holds again on a new one; the server lets go of
    the transfer (on_transfer_done(id, False)) only when the last of its holds ends, however
    late it notices the broken one."""
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("gpu", [])
    first = client.hold("127.0.0.1", server.port, "gpu", timeout=5)
    first.wait()
    second = client.hold("127.0.0.1", server.port, "gpu", timeout=5)
    second.wait()
    assert owner.held == ["gpu", "gpu"] and server.connections_accepted == 2
    first.abandon()
    wait_for_connections(server, 1)
    assert done.calls == []  # still held by the second connection
    second.abandon()
    assert done.wait_for(1) == [("gpu", False)]


def wait_for_connections(server: KVServer, count: int) -> None:
    """Until the server's connection threads are down to `count` (closed ones noticed)."""
    deadline = time.monotonic() + 5.0
    while len(server._connections) != count:
        assert time.monotonic() < deadline, f"{len(server._connections)} connections left"
        time.sleep(0.01)


def start_held_wait(client, server, handoff_id: str) -> tuple[threading.Thread, list]:
    """A held wait on handoff_id in a thread; what it returns goes into the list."""
    received: list = []
    waiter = threading.Thread(
        target=lambda: received.append(
            client.await_held_announcement(
                "127.0.0.1", server.port, handoff_id, timeout=5.0, hold_timeout=5.0
            )
        )
    )
    waiter.start()
    return waiter, received


def wait_with_hold(client, server, handoff_id: str) -> tuple[threading.Thread, list]:
    """Start a held wait on handoff_id in a thread, once it reached the server."""
    waiter, received = start_held_wait(client, server, handoff_id)
    deadline = time.monotonic() + 5.0
    while not server._handoffs.get(handoff_id) or server._handoffs[handoff_id].waiter is None:
        assert time.monotonic() < deadline, "the wait did not reach the server"
        time.sleep(0.01)
    return waiter, received


@pytest.mark.parametrize("announced_first", [False, True])
def test_an_announcement_comes_with_its_transfer_held(make_server, client, announced_first):
    """A held wait gets the named transfer held as the announcement goes out (by the announcing
    thread, or by the connection's when the wait comes second): no HELD to wait for, and the
    transfer stays until the release confirms it."""
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("gpu", [])
    message = {"remote_request_id": "gpu", "first_token_id": 7}
    if announced_first:
        server.announce("h", message, transfer_id="gpu")
        received = [
            client.await_held_announcement(
                "127.0.0.1", server.port, "h", timeout=5.0, hold_timeout=5.0
            )
        ]
    else:
        waiter, received = wait_with_hold(client, server, "h")
        server.announce("h", message, transfer_id="gpu")
        waiter.join(5.0)
    [(announcement, hold)] = received
    assert announcement == message and hold is not None
    assert owner.held == ["gpu"] and done.calls == []
    hold.wait()  # held already: returns at once
    assert_release_ends_the_transfer(hold, server, client, done)


def test_an_announcement_holds_only_what_can_be_held(make_server, client):
    """No hold asked for, no transfer named, a transfer with layers, one the owner refuses:
    the announcement comes without a hold, and the connection serves the next request."""
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("gpu", [])
    server.publish("layers", make_layers(1))
    server.publish("ended", [])
    owner.ended.add("ended")
    server.announce("plain", {"n": 0}, transfer_id="gpu")
    assert client.await_announcement("127.0.0.1", server.port, "plain", timeout=5.0) == {"n": 0}
    for handoff_id, transfer_id in (("none", None), ("layers", "layers"), ("ended", "ended")):
        server.announce(handoff_id, {"n": 1}, transfer_id=transfer_id)
        announcement, hold = client.await_held_announcement(
            "127.0.0.1", server.port, handoff_id, timeout=5.0, hold_timeout=5.0
        )
        assert (announcement, hold) == ({"n": 1}, None)
    assert owner.held == [] and done.calls == []
    assert server.connections_accepted == 1


def test_an_abandoned_announced_hold_lets_go(make_server, client):
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("gpu", [])
    waiter, received = wait_with_hold(client, server, "h")
    server.announce("h", {"remote_request_id": "gpu"}, transfer_id="gpu")
    waiter.join(5.0)
    [(_, hold)] = received
    hold.abandon()  # the decode failed after the announcement: the connection closes
    assert done.wait_for(1) == [("gpu", False)]  # the owner lets go; the transfer stays
    retry = client.hold("127.0.0.1", server.port, "gpu", timeout=5)
    retry.wait()
    retry.release()
    assert done.wait_for(2) == [("gpu", False), ("gpu", True)]


def test_a_handoff_announced_while_the_decode_waits_arrives_at_once(make_server, client):
    server, _ = make_server()
    message = {"remote_block_ids": [3, 1, 2], "first_token_id": 42, "kv_transport": "tcp"}
    received: list[dict] = []
    waiter = threading.Thread(
        target=lambda: received.append(
            client.await_announcement("127.0.0.1", server.port, "h1", timeout=5.0)
        )
    )
    waiter.start()
    time.sleep(0.2)  # the wait is in place before the announcement
    assert received == []
    announced = time.monotonic()
    server.announce("h1", message)
    waiter.join(5.0)
    assert received == [message]
    assert time.monotonic() - announced < 0.5
    # the connection went back to the pool and still serves a fetch
    layer = torch.arange(8, dtype=torch.float32)
    server.publish("t", [layer])
    out = torch.empty(8)
    client.fetch("127.0.0.1", server.port, "t", [out], timeout=5.0)
    assert torch.equal(out, layer)
    assert server.connections_accepted == 1


def test_the_announcing_thread_sends_to_a_waiting_decode_itself(make_server, client, monkeypatch):
    """An announcement for a decode worker that already waits goes out from the thread that
    announces (the engine's), not through the connection's thread; one announced before the
    wait is sent by the connection's thread when the wait arrives. Either way it is sent once,
    and the connection serves the client's next request."""
    from tandem.kv.control import server as kv_server

    senders: list[str] = []  # the threads that sent an ANNOUNCE
    send = kv_server.send_message

    def recording_send(sock, message_type, payload=b"", layer=0):
        if message_type == kv_server.ANNOUNCE:
            senders.append(threading.current_thread().name)
        send(sock, message_type, payload, layer)

    monkeypatch.setattr(kv_server, "send_message", recording_send)
    server, _ = make_server()
    received: list[dict] = []
    waiter = threading.Thread(
        target=lambda: received.append(
            client.await_announcement("127.0.0.1", server.port, "h", timeout=5.0)
        )
    )
    waiter.start()
    deadline = time.monotonic() + 5.0
    while not server._handoffs.get("h") or server._handoffs["h"].waiter is None:
        assert time.monotonic() < deadline, "the wait did not reach the server"
        time.sleep(0.01)
    server.announce("h", {"first_token_id": 7})
    waiter.join(5.0)
    assert received == [{"first_token_id": 7}]
    assert senders == [threading.current_thread().name]

    senders.clear()
    server.announce("early", {"first_token_id": 8})
    assert client.await_announcement("127.0.0.1", server.port, "early", timeout=5.0) == {
        "first_token_id": 8
    }
    assert len(senders) == 1 and senders[0] != threading.current_thread().name
    server.publish("t", [torch.arange(4, dtype=torch.float32)])
    out = torch.empty(4)
    client.fetch("127.0.0.1", server.port, "t", [out], timeout=5.0)
    assert torch.equal(out, torch.arange(4, dtype=torch.float32))
    assert server.connections_accepted == 1


def test_a_handoff_announced_before_the_wait_is_kept_for_it_and_its_retries(make_server, client):
    """An announcement stays for its TTL, claimed or not: a wait that comes again (its
    connection broke) gets it again; after the TTL it is gone."""
    server, _ = make_server(announcement_ttl=0.5)
    server.announce("early", {"error": "the prefill failed"})
    for _ in range(2):
        answer = client.await_announcement("127.0.0.1", server.port, "early", timeout=5.0)
        assert answer == {"error": "the prefill failed"}
    time.sleep(0.6)
    server.announce("other", {})  # sweeps what expired
    with pytest.raises(KVTransferError) as failure:
        client.await_announcement("127.0.0.1", server.port, "early", timeout=0.3)
    assert failure.value.kind == "timeout"


def test_an_unclaimed_announcement_expires(make_server, client):
    server, _ = make_server(announcement_ttl=0.1)
    server.announce("old", {"x": 1})
    time.sleep(0.2)
    server.announce("new", {"x": 2})  # sweeps what expired
    with pytest.raises(KVTransferError) as failure:
        client.await_announcement("127.0.0.1", server.port, "old", timeout=0.3)
    assert failure.value.kind == "timeout"
    assert client.await_announcement("127.0.0.1", server.port, "new", timeout=1.0) == {"x": 2}


def test_a_cancelled_wait_ends_and_the_server_forgets_it(make_server, client):
    server, _ = make_server()
    cancelled = threading.Event()
    failures: list[KVTransferError] = []

    def wait() -> None:
        try:
            client.await_announcement(
                "127.0.0.1", server.port, "h", timeout=30, cancelled=cancelled
            )
        except KVTransferError as exc:
            failures.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    cancelled.set()
    waiter.join(5.0)
    assert [f.kind for f in failures] == ["aborted"]
    assert time.monotonic() - started < 1.0
    deadline = time.monotonic() + 5.0  # the server's wait notices the closed connection
    while server._handoffs and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server._handoffs == {}


def test_a_held_wait_given_up_leaves_no_hold(make_server, client):
    """A held wait cancelled just before the announcement: whether the server sees the client
    gone first (nothing is held) or holds and sends first (the send or the wait for CONFIRM
    fails), no hold outlives the connection."""
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("gpu", [])
    cancelled = threading.Event()
    failures: list[KVTransferError] = []

    def wait() -> None:
        try:
            client.await_held_announcement(
                "127.0.0.1", server.port, "h", timeout=30, hold_timeout=30, cancelled=cancelled
            )
        except KVTransferError as exc:
            failures.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    cancelled.set()
    waiter.join(5.0)
    assert [f.kind for f in failures] == ["aborted"]
    server.announce("h", {"remote_request_id": "gpu"}, transfer_id="gpu")
    deadline = time.monotonic() + 5.0  # the connection's thread ends once it sees the close
    while server._connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not server._connections
    assert len(owner.held) == done.calls.count(("gpu", False)) <= 1
    assert ("gpu", True) not in done.calls


def test_a_wait_for_an_unreachable_server_is_a_connection_error(client):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(KVTransferError) as failure:
        client.await_announcement("127.0.0.1", port, "h", timeout=2.0)
    assert failure.value.kind == "connection"


def waiting_connection(server: KVServer, handoff_id: str, other_than=()) -> socket.socket:
    """The server's end of the connection that waits on handoff_id (not one of `other_than`)."""
    deadline = time.monotonic() + 5.0
    while True:
        handoff = server._handoffs.get(handoff_id)
        connection = handoff.waiter if handoff is not None else None
        if connection is not None and connection not in other_than:
            return connection
        assert time.monotonic() < deadline, "no new wait reached the server"
        time.sleep(0.01)


def wait_in_thread(client, server, handoff_id: str, hold: bool) -> tuple[threading.Thread, list]:
    """A wait (with a hold, or plain) on handoff_id in a thread; its result or error goes into
    the list."""
    outcome: list = []

    def wait() -> None:
        try:
            if hold:
                outcome.append(
                    client.await_held_announcement(
                        "127.0.0.1", server.port, handoff_id, timeout=10, hold_timeout=10
                    )
                )
            else:
                message = client.await_announcement(
                    "127.0.0.1", server.port, handoff_id, timeout=10
                )
                outcome.append((message, None))
        except KVTransferError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    return waiter, outcome


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("when", ["while waiting", "as the announcement goes out"])
def test_a_wait_whose_connection_breaks_is_retried_and_gets_the_announcement(
    make_server, retrying_client, monkeypatch, when, hold
):
    """The connection of a wait breaks before the announcement, or as it goes out (the server
    sent it, the client never gets it): the client waits again on a new connection and gets
    the announcement, with the transfer held anew when it asked for a hold; the broken
    connection's hold is let go without undoing the new one."""
    from tandem.kv.control import server as kv_server

    client, retries = retrying_client
    owner = HoldOwner()
    server, done = make_server(on_transfer_held=owner)
    server.publish("gpu", [])
    lost: list[socket.socket] = []
    if when == "as the announcement goes out":
        send = kv_server.send_message

        def losing_send(sock, message_type, payload=b"", layer=0):
            if message_type == kv_server.ANNOUNCE and not lost:
                lost.append(sock)
                sock.shutdown(socket.SHUT_RDWR)  # sent, as far as the server knows
                return
            send(sock, message_type, payload, layer)

        monkeypatch.setattr(kv_server, "send_message", losing_send)
    started = time.monotonic()
    waiter, outcome = wait_in_thread(client, server, "h", hold)
    first = waiting_connection(server, "h")
    if when == "while waiting":
        first.shutdown(socket.SHUT_RDWR)
        waiting_connection(server, "h", other_than=[first])
    message = {"remote_request_id": "gpu", "first_token_id": 7}
    server.announce("h", message, transfer_id="gpu")
    waiter.join(10.0)

    [(announcement, held)] = outcome
    assert announcement == message and time.monotonic() - started < 5.0
    assert retries.count == 1 and server.connections_accepted == 2
    if not hold:
        assert held is None and owner.held == []
        return
    wait_for_connections(server, 1)  # the broken one is gone, the hold's is left
    assert held is not None and server._transfers["gpu"].holds == 1
    before = len(done.calls)
    held.release()
    assert done.wait_for(before + 1)[-1] == ("gpu", True)
    assert "gpu" not in server._transfers


TCP_REPAIR = 19  # linux/tcp.h: a socket closed in repair mode goes without a FIN or a reset


def vanish_without_a_word(connection: socket.socket) -> None:
    """Close the server's end of a connection and tell its peer nothing, as when a reset
    reached only this side or its host went down (needs CAP_NET_ADMIN)."""
    try:
        connection.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
    except PermissionError:
        pytest.skip("closing a socket silently (TCP_REPAIR) needs CAP_NET_ADMIN")
    connection.close()


def test_a_wait_whose_server_end_vanished_is_found_by_keepalive_and_retried(
    make_server, retrying_client, monkeypatch
):
    """The server's end of a waiting connection disappears without a word to the client: the
    first keepalive probe meets a reset, and the client waits again on a new connection and
    gets the announcement, long before the wait's deadline (10 s) it would have sat out."""
    monkeypatch.setattr(wire, "KEEPALIVE_IDLE_S", 1)
    client, retries = retrying_client
    server, _ = make_server()
    started = time.monotonic()
    waiter, outcome = wait_in_thread(client, server, "h", hold=False)
    first = waiting_connection(server, "h")
    assert first.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)  # the server's side too
    time.sleep(0.5)  # the AWAIT acknowledged (no resend of it meets a reset), the client idle
    vanish_without_a_word(first)
    waiting_connection(server, "h", other_than=[first])
    message = {"remote_request_id": "gpu", "first_token_id": 7}
    server.announce("h", message)
    waiter.join(10.0)
    [(announcement, _)] = outcome
    assert announcement == message and retries.count == 1
    assert time.monotonic() - started < 5.0


def test_a_wait_on_an_engine_restarted_on_its_address_fails_at_once(make_server, client):
    """A decode waits on engine a's KV server; the worker restarts on the same port as engine
    b, whose server never saw the handoff: the wait, tried again there, fails at once
    ("not_found"), not at its deadline (what a's engine would have announced died with it)."""
    first, _ = make_server(engine_id="a")
    port = first.port
    started = time.monotonic()
    outcome: list = []

    def wait() -> None:
        try:
            client.await_announcement("127.0.0.1", port, "h", timeout=10.0, engine_id="a")
        except KVTransferError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiting_connection(first, "h")
    first.close()
    second = KVServer("127.0.0.1", port, engine_id="b")
    try:
        waiter.join(10.0)
        [error] = outcome
        assert error.kind == "not_found" and "engine a is gone" in str(error)
        assert time.monotonic() - started < 5.0
        # a wait for the engine that serves there is waited on as before
        second.announce("h2", {"x": 1})
        answer = client.await_announcement("127.0.0.1", port, "h2", timeout=5.0, engine_id="b")
        assert answer == {"x": 1}
    finally:
        second.close()


def test_a_wait_that_breaks_more_often_than_its_retries_fails(make_server, retrying_client):
    client, retries = retrying_client
    server, _ = make_server()
    waiter, outcome = wait_in_thread(client, server, "h", hold=False)
    broken: list[socket.socket] = []
    for _ in range(RETRY_ATTEMPTS):
        broken.append(waiting_connection(server, "h", other_than=broken))
        broken[-1].shutdown(socket.SHUT_RDWR)
    waiter.join(10.0)
    [error] = outcome
    assert isinstance(error, KVTransferError) and error.kind == "connection"
    assert retries.count == RETRY_ATTEMPTS - 1


# ---- the tcp data plane, block by block -----------------------------------------------------


def test_the_tcp_data_plane_reads_blocks_into_other_blocks(make_server):
    """A source cache's blocks, staged layer by layer and served over the KV port, land in the
    destination's blocks named for them, from first_block on; no other block changes."""
    from tandem.kv.data.base import BlockSource
    from tandem.kv.data.tcp import TcpDataPlane

    cpu = torch.device("cpu")
    shape = (3, 2, 10, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    source_cache = torch.randn(shape)
    source_blocks, local_blocks = [7, 2, 5, 0], [1, 9, 4]  # local hits cover remote block 0
    server, done = make_server()
    client = KVClient()
    source = TcpDataPlane(cpu, 5.0, None, lambda: None)
    destination = TcpDataPlane(cpu, 5.0, client, lambda: None)
    local_cache = torch.zeros(shape)
    source.register_kv_cache(source_cache)
    destination.register_kv_cache(local_cache)
    try:
        staged = source.stage("t", source_blocks)
        for layer in range(shape[0]):
            source.save_layer("t", layer)
        server.publish("t", staged.layers, staged.wait_layer)
        where = BlockSource("e", "127.0.0.1", server.port, "t", source_blocks, "", (0, 3), (0, 2))
        read = destination.start_read(where, local_blocks, first_block=1)
        assert read.wait(10)
        assert read.result() == source_cache[:, :, source_blocks[1:]].numel() * 4  # blocks read
        assert torch.equal(local_cache[:, :, local_blocks], source_cache[:, :, [2, 5, 0]])
        others = [block for block in range(shape[2]) if block not in local_blocks]
        assert not local_cache[:, :, others].any()
        assert done.wait_for(1) == [("t", True)]  # the read confirmed the transfer

        shard = BlockSource("e", "127.0.0.1", server.port, "t", source_blocks, "", (0, 3), (0, 1))
        with pytest.raises(KVTransferError, match="mismatch"):
            destination.start_read(shard, local_blocks, first_block=1).result()
    finally:
        source.close()
        destination.close()
        client.close()


def test_data_planes_load_only_when_chosen():
    code = (
        "import sys; from tandem.kv.data import data_plane_class; "
        "print(data_plane_class('tcp').__name__, 'tandem.kv.data.cuda_ipc' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["TcpDataPlane", "False"], result.stderr
    from tandem.kv.data import data_plane_class

    transports = "tcp, cuda-ipc, nixl, mooncake"
    with pytest.raises(ValueError, match=f"'rdma'; the transports are: {transports}"):
        data_plane_class("rdma")
