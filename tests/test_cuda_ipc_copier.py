"""The cuda-ipc block copier on the GPU: another process's blocks land intact in the local
cache, with the Triton kernel and with the torch fallback, on the same GPU and on another one;
a copy queued behind that process's event sees what the process wrote before it, and neither
the host nor the local stream waits for it meanwhile. Skipped without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda

SHAPE = (3, 2, 12, 16, 2, 64)  # [layers, 2, blocks, block_size, kv_heads, head_dim]
REMOTE_IDS, LOCAL_IDS = [7, 2, 9, 4], [1, 10, 3, 6]
SLEEP_CYCLES = 1_000_000_000  # half a second or more on the GPU: the copy must wait for it

PRODUCER = f"""
import sys, torch
from tandem.kv.data.cuda_ipc import export_handle
cache = torch.randn({SHAPE}, dtype=torch.bfloat16, device="cuda:0")
event = torch.cuda.Event(interprocess=True)
cache.add_(0)  # loads the kernel now: loading it later would wait for the sleep
torch.cuda.synchronize()
print(export_handle(cache), bytes(event.ipc_handle()).hex(), flush=True)
sys.stdin.readline()
torch.cuda._sleep({SLEEP_CYCLES})
cache.add_(1)
event.record()
print("recorded", flush=True)
sys.stdin.readline()
"""


def devices() -> list:
    two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
    return ["cuda:0", pytest.param("cuda:1", marks=two)]


@pytest.fixture
def producer():
    process = subprocess.Popen(
        [sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    yield process
    process.stdin.close()
    process.wait(30)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("local_device", devices())
def test_copies_blocks_behind_the_writers_event(producer, local_device, use_kernel):
    from tandem.kv.data.cuda_ipc import BlockCopier, open_handle

    handle, event_handle = producer.stdout.readline().split()
    remote = open_handle(handle, torch.device(local_device))
    before = remote[:, :, REMOTE_IDS].cpu()
    local = torch.zeros(SHAPE, dtype=torch.bfloat16, device=local_device)
    copier = BlockCopier(local)
    with torch.cuda.device(local_device):
        _, done = copier.launch(remote, REMOTE_IDS, LOCAL_IDS, use_kernel)
        done.synchronize()
        assert torch.equal(local[:, :, LOCAL_IDS].cpu(), before)
        others = [i for i in range(SHAPE[2]) if i not in LOCAL_IDS]
        assert not local[:, :, others].any()

        local.zero_()
        written = torch.cuda.Event.from_ipc_handle(
            torch.device(local_device), bytes.fromhex(event_handle)
        )
        producer.stdin.write("\n")
        producer.stdin.flush()
        assert producer.stdout.readline().strip() == "recorded"
        for _ in range(3):  # queuing copies behind copies that wait does not wait either
            _, done = copier.launch(remote, REMOTE_IDS, LOCAL_IDS, use_kernel, after=written)
        assert not written.query()
        torch.cuda.current_stream().synchronize()  # the local stream does not wait for the copy
        assert not done.query()
        done.synchronize()
        after = remote[:, :, REMOTE_IDS].cpu()
        assert not torch.equal(after, before)
        assert torch.equal(local[:, :, LOCAL_IDS].cpu(), after)
