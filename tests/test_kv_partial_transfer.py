"""Partial KV transfer over tcp: a decode worker whose prefix cache holds a prompt's first blocks
fetches the rest only (FETCH's first_block).

Unit, on real sockets: a fetch from block k gets exactly blocks k.. of each layer, equal to the
torch slice `layer[:, k:]`, and fewer bytes cross the wire by the blocks it skips (counted by a
raw client written from docs/protocol.md); block 0 is the whole layer as before; a block the
layers do not have is a mismatch. The tcp data plane reads into staging of the blocks read
only, installs them into the local blocks, and on a tensor-parallel rank 0 keeps them for
`install_shards`, which writes them as they are (no second slice).
The prefill side counts what it served: the server reports, for each confirmed transfer, the
bytes a fetch sent and the blocks it got, or the blocks a hold's CONFIRM says the decode read
in place (an older client's CONFIRM says nothing: the whole transfer), and the control plane
turns that into tandem_kv_transfer_bytes_served / _blocks_served.
End to end on CPU: a prefill and a decode worker, and a second turn that extends the first
one's prompt and answer: the decode leg hits its prefix cache, receives only the missing
blocks (tandem_kv_transfer_bytes_received), and answers as a colocated worker does; nothing is
held afterwards. Through a router, the prefill worker's bytes served per turn are the blocks
the decode lacked times a block's bytes (from the checkpoint's config).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import torch

from kv_wire import (
    CONFIRM,
    DONE,
    ERROR,
    FETCH,
    LAYER,
    WIRE_HEADER,
    DoneRecorder,
    make_layers,
    message,
    raw_connect,
    recv_exact,
)
from pd_fixtures import (
    assert_nothing_held,
    metric,
    post,
    prefill_leg,
    run_direct,
    running_processes,
    running_workers,
    token_prompt,
    wait_for_value,
    with_defaults,
)
from tandem.kv.config import KVTransferConfig
from tandem.kv.connector.metadata import InstallSpec
from tandem.kv.connector.ranks import install_shards
from tandem.kv.control.client import KVClient
from tandem.kv.control.plane import ControlPlane
from tandem.kv.control.server import KVServer
from tandem.kv.data.base import BlockSource, StagedTransfer
from tandem.kv.data.tcp import TcpDataPlane
from tandem.kv.errors import KVTransferError
from worker_fixtures import WorkerProcess, start_tandem

NUM_BLOCKS = 5
HELD = 8  # the answer to a hold (docs/protocol.md)


@pytest.fixture
def server() -> Iterator[tuple[KVServer, DoneRecorder]]:
    done = DoneRecorder()
    kv_server = KVServer("127.0.0.1", 0, on_transfer_done=done)
    yield kv_server, done
    kv_server.close()


@pytest.fixture
def client() -> Iterator[KVClient]:
    kv_client = KVClient()
    yield kv_client
    kv_client.close()


def tail(layers: list[torch.Tensor], first_block: int) -> list[torch.Tensor]:
    """The reference: what a fetch from first_block should deliver of each layer."""
    return [layer[:, first_block:].contiguous() for layer in layers]


def raw_fetch(port: int, transfer_id: str, layer_nbytes: list[int], first_block: int):
    """A FETCH from first_block by a raw client: (the layers' payloads, every byte the server
    sent until DONE)."""
    request = {"transfer_id": transfer_id, "layer_nbytes": layer_nbytes}
    if first_block:
        request["first_block"] = first_block
    sock = raw_connect(port)
    try:
        sock.sendall(message(FETCH, msgspec.msgpack.encode(request)))
        payloads, wire_bytes = [], 0
        for index in range(len(layer_nbytes)):
            kind, layer, length = WIRE_HEADER.unpack(recv_exact(sock, WIRE_HEADER.size))[1:]
            assert (kind, layer) == (LAYER, index)
            payloads.append(recv_exact(sock, length))
            wire_bytes += WIRE_HEADER.size + length
        sock.sendall(message(CONFIRM))
        kind, _, length = WIRE_HEADER.unpack(recv_exact(sock, WIRE_HEADER.size))[1:]
        assert (kind, length) == (DONE, 0)
        return payloads, wire_bytes + WIRE_HEADER.size
    finally:
        sock.close()


@pytest.mark.parametrize("first_block", [0, 1, 3, NUM_BLOCKS - 1])
def test_a_fetch_from_a_block_gets_exactly_the_blocks_from_it(server, client, first_block):
    kv_server, done = server
    layers = make_layers(seed=first_block, num_blocks=NUM_BLOCKS)  # float32 and bfloat16
    want = tail(layers, first_block)
    kv_server.publish("client", layers)
    received = [torch.full_like(layer, float("nan")) for layer in want]
    arrived: list[int] = []
    client.fetch(
        "127.0.0.1",
        kv_server.port,
        "client",
        received,
        timeout=10.0,
        on_layer=arrived.append,
        first_block=first_block,
    )
    assert arrived == list(range(len(layers)))
    for index, (got, expected) in enumerate(zip(received, want, strict=True)):
        assert torch.equal(got, expected), f"layer {index}"
    assert done.wait_for(1) == [("client", True)]

    kv_server.publish("raw", layers)
    nbytes = [layer.numel() * layer.element_size() for layer in want]
    payloads, wire_bytes = raw_fetch(kv_server.port, "raw", nbytes, first_block)
    assert payloads == [layer.reshape(-1).view(torch.uint8).numpy().tobytes() for layer in want]
    whole = sum(layer.numel() * layer.element_size() for layer in layers)
    headers = (len(layers) + 1) * WIRE_HEADER.size  # a LAYER each, then DONE
    assert wire_bytes == headers + whole * (NUM_BLOCKS - first_block) // NUM_BLOCKS
    assert done.wait_for(2)[1] == ("raw", True)


@pytest.mark.parametrize(
    ("layers", "first_block", "sizes"),
    [
        (make_layers(seed=1, num_blocks=NUM_BLOCKS), NUM_BLOCKS, "no block"),
        (make_layers(seed=1, num_blocks=NUM_BLOCKS), -1, "no block"),
        (make_layers(seed=1, num_blocks=NUM_BLOCKS), 2, "whole"),  # sizes of whole layers
        ([torch.arange(8, dtype=torch.float32)], 1, "no block"),  # a layer without blocks
    ],
    ids=["past-the-last", "negative", "whole-sizes", "no-blocks"],
)
def test_a_fetch_the_layers_cannot_serve_is_a_mismatch(server, client, layers, first_block, sizes):
    """The server answers a mismatch and keeps the transfer; a right fetch then gets it."""
    kv_server, done = server
    kv_server.publish("t", layers)
    wrong = [torch.zeros_like(layer if sizes == "whole" else layer[:1]) for layer in layers]
    with pytest.raises(KVTransferError, match="mismatch") as error:
        client.fetch("127.0.0.1", kv_server.port, "t", wrong, timeout=10.0, first_block=first_block)
    assert "transfer 't'" in str(error.value)
    assert done.wait_for(1) == [("t", False)]
    received = [torch.zeros_like(layer) for layer in layers]
    client.fetch("127.0.0.1", kv_server.port, "t", received, timeout=10.0)
    assert all(torch.equal(a, b) for a, b in zip(received, layers, strict=True))


def test_an_old_fetch_without_first_block_reads_whole_layers(server):
    """A FETCH that does not name first_block (an older client) gets whole layers."""
    kv_server, _ = server
    layers = make_layers(seed=3, num_blocks=NUM_BLOCKS)
    kv_server.publish("t", layers)
    nbytes = [layer.numel() * layer.element_size() for layer in layers]
    payloads, _ = raw_fetch(kv_server.port, "t", nbytes, first_block=0)
    assert payloads == [layer.reshape(-1).view(torch.uint8).numpy().tobytes() for layer in layers]

    kv_server.publish("u", layers)
    sock = raw_connect(kv_server.port)  # the tail's sizes without first_block: refused
    try:
        short = [n * 2 // NUM_BLOCKS for n in nbytes]
        request = {"transfer_id": "u", "layer_nbytes": short}
        sock.sendall(message(FETCH, msgspec.msgpack.encode(request)))
        kind = WIRE_HEADER.unpack(recv_exact(sock, WIRE_HEADER.size))[1]
        assert kind == ERROR
    finally:
        sock.close()


# ---- what the prefill side counts as served ---------------------------------------------------


class ServedRecorder:
    """Collects a server's on_transfer_served calls: (id, bytes, blocks)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None, int | None]] = []
        self.lock = threading.Lock()

    def __call__(self, transfer_id: str, num_bytes: int | None, num_blocks: int | None) -> None:
        with self.lock:
            self.calls.append((transfer_id, num_bytes, num_blocks))


def held_confirm(port: int, transfer_id: str, layer: int) -> None:
    """A hold by a raw client: FETCH (hold), HELD, then CONFIRM with `layer` in its header
    (1 + the blocks read; 0 as a client that does not say), then DONE."""
    sock = raw_connect(port)
    try:
        request = {"transfer_id": transfer_id, "layer_nbytes": [], "hold": True}
        sock.sendall(message(FETCH, msgspec.msgpack.encode(request)))
        assert WIRE_HEADER.unpack(recv_exact(sock, WIRE_HEADER.size))[1] == HELD
        sock.sendall(message(CONFIRM, layer=layer))
        assert WIRE_HEADER.unpack(recv_exact(sock, WIRE_HEADER.size))[1] == DONE
    finally:
        sock.close()


def test_the_server_reports_what_each_confirmed_transfer_served(client):
    """A fetch: the payload bytes it got and its blocks; a hold: the blocks its CONFIRM says
    were read (none said: None); a release: nothing. A fetch that broke reports nothing."""
    served, done = ServedRecorder(), DoneRecorder()
    kv_server = KVServer("127.0.0.1", 0, on_transfer_done=done, on_transfer_served=served)
    try:
        layers = make_layers(seed=5, num_blocks=NUM_BLOCKS)
        for first_block in (0, 3):
            kv_server.publish(f"fetch-{first_block}", layers)
            received = [torch.empty_like(layer) for layer in tail(layers, first_block)]
            client.fetch(
                "127.0.0.1",
                kv_server.port,
                f"fetch-{first_block}",
                received,
                timeout=10.0,
                first_block=first_block,
            )
        whole = sum(layer.numel() * layer.element_size() for layer in layers)
        tail_bytes = whole * (NUM_BLOCKS - 3) // NUM_BLOCKS
        kv_server.publish("broken", layers)
        with pytest.raises(KVTransferError, match="mismatch"):
            client.fetch("127.0.0.1", kv_server.port, "broken", layers[:1], timeout=10.0)
        for name in ("hold-2", "hold-0", "old", "released"):
            kv_server.publish(name, [])  # read in place: nothing staged
        hold = client.hold("127.0.0.1", kv_server.port, "hold-2", timeout=10.0)
        hold.wait()
        hold.release(2)
        hold = client.hold("127.0.0.1", kv_server.port, "hold-0", timeout=10.0)
        hold.wait()
        hold.release(0)  # the decode needed none of the blocks
        held_confirm(kv_server.port, "old", layer=0)
        client.release("127.0.0.1", kv_server.port, "released", timeout=10.0)
        assert served.calls == [
            ("fetch-0", whole, NUM_BLOCKS),
            ("fetch-3", tail_bytes, NUM_BLOCKS - 3),
            ("hold-2", None, 2),
            ("hold-0", None, 0),
            ("old", None, None),
            ("released", 0, 0),
        ]
        assert ("broken", False) in done.calls
    finally:
        kv_server.close()


def test_the_control_plane_counts_the_bytes_served(client):
    """tcp: the bytes a fetch from block k sent; in place: the blocks read times a block's
    bytes (all of the lease's blocks for a CONFIRM that does not say)."""
    control = ControlPlane(KVTransferConfig(role="prefill"))
    try:
        layers = make_layers(seed=6, num_blocks=NUM_BLOCKS)
        control.publish("tcp", StagedTransfer(layers), NUM_BLOCKS, {})
        want = tail(layers, 2)
        received = [torch.empty_like(layer) for layer in want]
        client.fetch("127.0.0.1", control.port, "tcp", received, timeout=10.0, first_block=2)
        tail_bytes = sum(layer.numel() * layer.element_size() for layer in want)
        stats = control.stats()
        assert (stats["kv_bytes_served"], stats["kv_blocks_served"]) == (tail_bytes, 3)
        assert control.stats()["kv_bytes_served"] == 0  # what happened since the last call

        for name in ("said", "unsaid"):
            control.publish(name, StagedTransfer([]), NUM_BLOCKS, {}, block_bytes=1000)
            control.make_transferable(name)
        hold = client.hold("127.0.0.1", control.port, "said", timeout=10.0)
        hold.wait()
        hold.release(3)
        held_confirm(control.port, "unsaid", layer=0)
        stats = control.stats()
        assert (stats["kv_bytes_served"], stats["kv_blocks_served"]) == (
            3000 + NUM_BLOCKS * 1000,
            3 + NUM_BLOCKS,
        )  # counted before DONE went out
    finally:
        control.close()


# ---- the tcp data plane ----------------------------------------------------------------------

CACHE_SHAPE = (3, 2, 12, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_dim]
SOURCE_BLOCKS = [7, 2, 5, 0, 11]
FIRST_BLOCK = 2
LOCAL_BLOCKS = [1, 9, 4]  # remote blocks 2.. land here (local hits cover blocks 0 and 1)


class OneRankRelay:
    """A tensor-parallel rank 0 alone in its group: what HeadRelay does with one rank."""

    layout = SimpleNamespace(num_kv_heads=CACHE_SHAPE[4])

    def gather_heads(self, shard: torch.Tensor) -> torch.Tensor:
        return shard

    def scatter_heads(self, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        assert whole.shape == like.shape, "the host layers must hold the blocks read only"
        return whole.clone()


def staged_source(server: KVServer) -> tuple[TcpDataPlane, torch.Tensor]:
    source_cache = torch.randn(CACHE_SHAPE)
    source = TcpDataPlane(torch.device("cpu"), 5.0, None, lambda: None)
    source.register_kv_cache(source_cache)
    staged = source.stage("t", SOURCE_BLOCKS)
    for layer in range(CACHE_SHAPE[0]):
        source.save_layer("t", layer)
    server.publish("t", staged.layers, staged.wait_layer)
    return source, source_cache


@pytest.mark.parametrize("relay", [False, True], ids=["one-rank", "tp-rank-0"])
def test_the_tcp_plane_reads_only_the_blocks_it_lacks(server, client, relay):
    kv_server, done = server
    source, source_cache = staged_source(kv_server)
    destination = TcpDataPlane(torch.device("cpu"), 5.0, client, lambda: None)
    local_cache = torch.zeros(CACHE_SHAPE)
    destination.register_kv_cache(local_cache)
    if relay:
        destination.relay = OneRankRelay()
    where = BlockSource("e", "127.0.0.1", kv_server.port, "t", SOURCE_BLOCKS, "", (0, 3), (0, 2))
    try:
        read = destination.start_read(where, LOCAL_BLOCKS, FIRST_BLOCK)
        assert read.wait(10)
        wanted = source_cache[:, :, SOURCE_BLOCKS[FIRST_BLOCK:]]
        assert read.result() == wanted.numel() * wanted.element_size()
        assert done.wait_for(1) == [("t", True)]
        if relay:  # rank 0 keeps the blocks read; every rank installs them in a later step
            assert not local_cache.any()
            assert [tuple(layer.shape) for layer in read.host_layers] == [
                (2, len(LOCAL_BLOCKS), *CACHE_SHAPE[3:])
            ] * CACHE_SHAPE[0]
            install = InstallSpec("r", LOCAL_BLOCKS)
            install_shards(OneRankRelay(), local_cache, install, read.host_layers)
        assert torch.equal(local_cache[:, :, LOCAL_BLOCKS], wanted)
        others = [block for block in range(CACHE_SHAPE[2]) if block not in LOCAL_BLOCKS]
        assert not local_cache[:, :, others].any()
    finally:
        source.close()
        destination.close()


# ---- end to end: a second turn reads only what the decode lacks ------------------------------

CHECKPOINT = "llama-gqa"
BLOCK_SIZE = 16
VOCAB = (1, 512)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def workers(tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    blocks = ("--num-kv-blocks", "256")
    specs = {
        "prefill": ("--role", "prefill", *blocks),
        "decode": ("--role", "decode", *blocks),
        "both": ("--role", "both", *blocks),
    }
    model = str(tiny_checkpoints[CHECKPOINT])
    with running_workers(tmp_path_factory.mktemp("partial"), specs, model) as started:
        yield started


def block_bytes(kv_layout: str) -> int:
    """The bytes of one block of every layer, from kv_transfer_params' kv_layout
    ("{layers}x2x{kv_heads}x{head_dim}:float32")."""
    shape, dtype = kv_layout.split(":")
    assert dtype == "float32"
    layers, two, heads, head_dim = map(int, shape.split("x"))
    return layers * two * heads * head_dim * BLOCK_SIZE * 4


def pd_turn(http: httpx.Client, workers: dict, prompt: list[int]) -> tuple[list[int], int, float]:
    """One PD request (greedy) checked against the colocated worker: (its answer's token ids,
    the prompt's blocks, the blocks' worth of bytes the decode received for it)."""
    body = with_defaults({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0})
    before = metric(workers["decode"], "tandem_kv_transfer_bytes_received")
    params = prefill_leg(http, workers["prefill"].url, "/v1/completions", body)[
        "kv_transfer_params"
    ]
    answer = post(
        http, workers["decode"].url + "/v1/completions", dict(body, kv_transfer_params=params)
    )
    assert answer == run_direct(http, workers["both"].url, "/v1/completions", body)
    assert len(answer.token_ids) == MAX_TOKENS
    received = metric(workers["decode"], "tandem_kv_transfer_bytes_received") - before
    blocks_received = received / block_bytes(params["kv_layout"])
    return answer.token_ids, len(params["remote_block_ids"]), blocks_received


def test_a_second_turn_moves_only_the_blocks_the_decode_lacks(workers):
    first_prompt = token_prompt(11, 40, *VOCAB)  # 2 full blocks and 8 tokens
    with httpx.Client() as http:
        first_answer, first_blocks, first_received = pd_turn(http, workers, first_prompt)
        # the decode computed the first turn's tokens 0..46 (the last answer token has no KV
        # yet): its prefix cache holds 2 full blocks of them, which the second turn starts with
        second_prompt = first_prompt + first_answer + token_prompt(12, 30, *VOCAB)
        _, second_blocks, second_received = pd_turn(http, workers, second_prompt)
    assert (first_blocks, second_blocks) == (3, 5)
    assert first_received == 3  # no hit: every block
    assert second_received == 5 - 2
    assert_nothing_held(workers["prefill"], workers["decode"])


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory) -> Iterator[WorkerProcess]:
    start = functools.partial(
        start_tandem,
        tmp_path_factory.mktemp("partial-router"),
        "router",
        "--prefill",
        workers["prefill"].url,
        "--decode",
        workers["decode"].url,
    )
    with running_processes({"router": start}) as started:
        yield started["router"]


def checkpoint_block_bytes(checkpoint: Path) -> int:
    """One block of every layer's keys and values, from the checkpoint's config (float32)."""
    config = json.loads((checkpoint / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim
    return per_token * BLOCK_SIZE * 4


def test_the_prefill_worker_serves_a_second_turn_only_the_blocks_the_decode_lacks(
    workers, router, tiny_checkpoints
):
    """Through the router (the second turn streamed: the handoff flow), the prefill worker's
    tandem_kv_transfer_bytes_served grows by the blocks each turn's decode leg lacked times a
    block's bytes: every block of the first turn, then the blocks past the decode's prefix."""
    block_bytes = checkpoint_block_bytes(tiny_checkpoints[CHECKPOINT])
    served = "tandem_kv_transfer_bytes_served_total"
    first_prompt = token_prompt(21, 100, *VOCAB)  # 6 full blocks and 4 tokens
    with httpx.Client() as http:
        body = {"prompt": first_prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        before = metric(workers["prefill"], served)
        first = run_direct(http, router.url, "/v1/completions", body)
        assert first == run_direct(http, workers["both"].url, "/v1/completions", body)
        wait_for_value(workers["prefill"], served, before + 7 * block_bytes, timeout=10.0)
        # the decode computed tokens 0..106 of the first turn: 6 full blocks in its prefix
        # cache; the second turn's 118 tokens are 8 blocks, of which it lacks 2
        second_prompt = first_prompt + first.token_ids + token_prompt(22, 10, *VOCAB)
        body = dict(body, prompt=second_prompt, stream=True)
        second = run_direct(http, router.url, "/v1/completions", body)
        assert second == run_direct(http, workers["both"].url, "/v1/completions", body)
        assert len(second.token_ids) == MAX_TOKENS
        wait_for_value(workers["prefill"], served, before + 9 * block_bytes, timeout=10.0)
    assert_nothing_held(workers["prefill"], workers["decode"])
