"""The nixl and mooncake data planes, each on CPU over loopback (UCX_TLS=tcp for NIXL, Mooncake's
tcp protocol): block reads between two processes against a torch copy, PD through the router
token-identical to a `both` worker, failures (the prefill killed, the lease withdrawn) handled
by the load failure policy with nothing held, and PD across two network namespaces.

Skipped where the library is not installed (`make test` installs both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from pd_fixtures import (
    assert_nothing_held,
    failures,
    metric,
    post,
    prefill_leg,
    prompt_set,
    run_direct,
    running_routers,
    running_workers,
    token_prompt,
    wait_for_value,
    with_defaults,
)
from tandem.kv.data import data_plane_class, installed
from tandem.kv.data.base import BlockSource
from tandem.kv.data.registered import block_regions, decode_handle
from tandem.kv.errors import KVTransferError

TRANSPORTS = [
    pytest.param(name, marks=pytest.mark.skipif(not installed(name), reason=f"{name} missing"))
    for name in ("nixl", "mooncake")
]
CHECKPOINT = "llama-gqa"
SHAPE = (3, 2, 40, 4, 2, 8)  # layers, key|value, blocks, block size, KV heads, head dim
READ_TIMEOUT_S = 10.0
os.environ.setdefault("UCX_TLS", "tcp")  # this host has no RDMA: UCX over TCP, as in CI

SOURCE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from tandem.kv.data import data_plane_class
    torch.manual_seed(int(sys.argv[2]))
    cache = torch.randn(*json.loads(sys.argv[3]))
    plane = data_plane_class(sys.argv[1])(torch.device("cpu"), 10.0, None, lambda: None)
    plane.register_kv_cache(cache)
    print("exported", json.dumps(plane.export()), flush=True)
    sys.stdin.read()  # serve until the test closes stdin (or kills this process)
    """
)


def source_cache(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(*SHAPE)


def start_source(transport: str, seed: int) -> tuple[subprocess.Popen, dict]:
    source_dir = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(os.environ, PYTHONPATH=source_dir)
    process = subprocess.Popen(
        [sys.executable, "-c", SOURCE_SCRIPT, transport, str(seed), json.dumps(SHAPE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    for line in process.stdout:  # the libraries log to stdout too
        if line.startswith("exported "):
            return process, json.loads(line.removeprefix("exported "))
    raise AssertionError(f"the {transport} source exited with {process.wait()}")


def block_source(exported: dict, block_ids: list[int]) -> BlockSource:
    layout = f"{SHAPE[0]}x2x{SHAPE[4]}x{SHAPE[5]}:float32"
    return BlockSource(
        "source", "127.0.0.1", 1, "transfer", block_ids, layout, (0, SHAPE[0]), (0, SHAPE[4]),
        exported,
    )  # fmt: skip


@pytest.fixture
def destination(request) -> Iterator:
    plane = data_plane_class(request.param)(torch.device("cpu"), READ_TIMEOUT_S, None, lambda: 0)
    plane.register_kv_cache(torch.zeros(*SHAPE))
    yield plane
    plane.close()


@pytest.mark.parametrize(
    "remote_ids, local_ids, runs",
    [
        ([5, 6, 7, 20, 3, 4], [0, 1, 2, 3, 9, 10], 3),  # 5-7, 20, 3-4: breaks on either side
        ([8, 7, 6, 30, 12, 11], [20, 19, 18, 2, 5, 4], 6),  # descending: a region a block
        ([4, 5, 6, 9, 8], [3, 2, 1, 10, 11], 5),  # one side up, the other down: no run
        ([1, 2, 3, 22, 21], [7, 8, 9, 4, 3], 3),  # 1-3 up, then 22 and 21 down
    ],
)
def test_block_regions_copy_what_an_index_copy_does(remote_ids, local_ids, runs):
    source, target = torch.randn(*SHAPE), torch.zeros(*SHAPE)
    block_bytes = source[0, 0, 0].numel() * 4
    regions = block_regions(
        target.data_ptr(), SHAPE[2], local_ids, source.data_ptr(), SHAPE[2], remote_ids,
        SHAPE[0] * 2, block_bytes,
    )  # fmt: skip
    assert len(regions) == SHAPE[0] * 2 * runs
    source_bytes = source.view(torch.uint8).view(-1).numpy()
    target_bytes = target.view(torch.uint8).view(-1).numpy()
    for local, remote, length in regions.astype(np.int64):
        start, at = remote - source.data_ptr(), local - target.data_ptr()
        target_bytes[at : at + length] = source_bytes[start : start + length]
    reference = torch.zeros(*SHAPE)
    reference[:, :, local_ids] = source[:, :, remote_ids]
    assert torch.equal(target, reference)


@pytest.mark.parametrize("destination", TRANSPORTS, indirect=True)
def test_two_process_block_reads_match_a_torch_copy(destination):
    transport = type(destination).library
    process, exported = start_source(transport, seed=3)
    try:
        remote = source_cache(3)
        for remote_ids, local_ids, first_block in [
            ([4, 5, 6, 7], [10, 11, 12, 13], 0),
            ([30, 2, 17, 8, 9, 1], [1, 3, 5, 6, 7], 1),  # the first block was cached locally
            ([9, 8, 7, 3], [15, 14, 13, 0], 0),  # descending on both sides: block by block
        ]:
            read = destination.start_read(
                block_source(exported, remote_ids), local_ids, first_block
            )
            assert read.wait(READ_TIMEOUT_S + 10)
            expected_bytes = len(local_ids) * SHAPE[0] * 2 * remote[0, 0, 0].numel() * 4
            assert read.result() == expected_bytes
            got = destination.kv_cache[:, :, local_ids]
            assert torch.equal(got, remote[:, :, remote_ids[first_block:]])
    finally:
        process.stdin.close()
        process.wait(timeout=30)


@pytest.mark.parametrize("destination", TRANSPORTS, indirect=True)
def test_a_killed_source_fails_the_read_with_a_transfer_error(destination):
    transport = type(destination).library
    process, exported = start_source(transport, seed=4)
    process.kill()
    process.wait()
    started = time.monotonic()
    read = destination.start_read(block_source(exported, [1, 2, 3]), [4, 5, 6], 0)
    assert read.wait(READ_TIMEOUT_S + 15), "the read never ended"
    with pytest.raises(KVTransferError):
        read.result()
    assert time.monotonic() - started < READ_TIMEOUT_S + 15


@pytest.mark.parametrize("destination", TRANSPORTS, indirect=True)
def test_a_malformed_handle_is_a_mismatch(destination):
    with pytest.raises(KVTransferError) as raised:
        destination.start_read(block_source({"kv_memory_handle": "bm90IGEgaGFuZGxl"}, [1]), [2], 0)
    assert raised.value.kind == "mismatch"
    with pytest.raises(KVTransferError):
        decode_handle(None)


# -- real workers ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request, tiny_checkpoints, tmp_path_factory) -> Iterator[dict]:
    transport = request.param
    flags = ("--kv-transport", transport, "--num-kv-blocks", "512")
    specs = {
        "prefill": ("--role", "prefill", *flags),
        "decode": ("--role", "decode", *flags, "--kv-transfer-timeout", "5"),
        "both": ("--role", "both", "--num-kv-blocks", "512"),
    }
    log_dir = tmp_path_factory.mktemp(f"pd-{transport}")
    model = str(tiny_checkpoints[CHECKPOINT])
    with running_workers(log_dir, specs, model) as workers:
        prefill, decode = workers["prefill"].url, workers["decode"].url
        with running_routers(log_dir, prefill, decode) as routers:
            yield {**workers, "router": routers["handoff"], "log_dir": log_dir, "model": model}


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as http:
        yield http


def test_pd_through_the_router_matches_a_both_worker(cluster, client):
    prompts = prompt_set(1000, 1, 512)[:16]
    for index, prompt in enumerate(prompts):
        body = {"prompt": prompt, "max_tokens": 8, "stream": index % 2 == 1}
        body.update({"temperature": 0.0} if index % 4 < 2 else {"temperature": 0.8, "seed": 11})
        through_router = post(
            client, cluster["router"].url + "/v1/completions", with_defaults(body)
        )
        reference = run_direct(client, cluster["both"].url, "/v1/completions", body)
        assert through_router == reference, f"prompt {index} ({len(prompt)} tokens)"
    assert_nothing_held(cluster["prefill"], cluster["decode"])
    assert metric(cluster["decode"], "tandem_kv_transfer_blocks_received") > 0
    assert metric(cluster["decode"], "tandem_kv_transfer_failures_total") == 0
    # read in place: the prefill counts what each confirmation says the decode read
    for unit in ("bytes", "blocks"):
        received = metric(cluster["decode"], f"tandem_kv_transfer_{unit}_received")
        served = f"tandem_kv_transfer_{unit}_served_total"
        wait_for_value(cluster["prefill"], served, received, timeout=10.0)


def test_a_withdrawn_lease_is_recomputed_and_nothing_is_held(cluster, client):
    prefill, decode = cluster["prefill"], cluster["decode"]
    body = with_defaults(
        {"prompt": token_prompt(901, 120, 1, 512), "max_tokens": 8, "temperature": 0.0}
    )
    params = prefill_leg(client, prefill.url, "/v1/completions", body)["kv_transfer_params"]
    release = {"remote_request_id": params["remote_request_id"]}
    assert client.post(prefill.url + "/v1/kv/release", json=release).status_code == 200
    answer = post(client, decode.url + "/v1/completions", dict(body, kv_transfer_params=params))
    assert answer == run_direct(client, cluster["both"].url, "/v1/completions", body)
    assert failures(decode, "not_found") + failures(decode, "aborted") >= 1
    assert_nothing_held(prefill, decode)


def test_a_killed_prefill_is_recomputed_and_nothing_is_held(cluster, client):
    """Last (it kills the module's prefill worker): the decode's read of a dead peer fails,
    and the request is recomputed on the decode worker."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    body = with_defaults(
        {"prompt": token_prompt(902, 120, 1, 512), "max_tokens": 8, "temperature": 0.0}
    )
    params = prefill_leg(client, prefill.url, "/v1/completions", body)["kv_transfer_params"]
    prefill.kill()
    answer = post(client, decode.url + "/v1/completions", dict(body, kv_transfer_params=params))
    assert answer == run_direct(client, cluster["both"].url, "/v1/completions", body)
    assert metric(decode, "tandem_kv_transfer_failures_total") >= 1
    assert_nothing_held(decode)
