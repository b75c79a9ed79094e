"""CUDA IPC handles are plain data: what `export_handle` writes decodes to the same arguments of
torch's rebuild, and a handle holding anything else (a pickle, a type off the list) is refused
without running it. The encoding is checked on CPU with arguments of the shape torch gives."""

from __future__ import annotations

import base64
import os
import pickle

import msgspec
import pytest
import torch

from tandem.kv.data import cuda_ipc
from tandem.kv.data.cuda_ipc import InvalidHandle, decode_handle

# rebuild_cuda_tensor's arguments as reduce_tensor returns them for a CUDA tensor
ARGS = (
    torch.Tensor, torch.Size([30, 2, 64, 16, 3, 64]), (393216, 196608, 3072, 192, 64, 1), 0,
    torch.UntypedStorage, torch.bfloat16, 0, b"\x01\x02ipc", 707788800, 0, False, b"ref", 64,
    b"\x00event", True,
)  # fmt: skip


def encode(fields) -> str:
    return base64.b64encode(msgspec.msgpack.encode(fields)).decode()


def test_a_handle_decodes_to_the_arguments_it_was_made_of(monkeypatch):
    monkeypatch.setattr(
        cuda_ipc, "reduce_tensor", lambda tensor: (cuda_ipc.rebuild_cuda_tensor, ARGS)
    )
    decoded = decode_handle(cuda_ipc.export_handle(torch.empty(0)))
    assert decoded == list(ARGS)
    assert [type(value) for value in decoded] == [type(value) for value in ARGS]


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/tandem-pwned",))


@pytest.mark.parametrize(
    "handle",
    [
        base64.b64encode(pickle.dumps(RunsCode())).decode(),  # what a pickle handle would run
        base64.b64encode(pickle.dumps(ARGS)).decode(),  # even a real pickle is not read
        encode([{"type": "system"}]),
        encode([{"type": "Tensor", "dtype": "float16"}]),
        encode([{"dtype": "__class__"}]),
        encode([{"size": ["a"]}]),
        encode([[1, 2]]),
        encode({"type": "Tensor"}),
        "not base64!",
    ],
)
def test_anything_else_is_refused_unread(handle):
    with pytest.raises(InvalidHandle):
        decode_handle(handle)
    assert not os.path.exists("/tmp/tandem-pwned")


def test_a_type_off_the_list_is_not_exported(monkeypatch):
    args = (os.system, *ARGS[1:])
    monkeypatch.setattr(
        cuda_ipc, "reduce_tensor", lambda tensor: (cuda_ipc.rebuild_cuda_tensor, args)
    )
    with pytest.raises(ValueError, match="cannot carry"):
        cuda_ipc.export_handle(torch.empty(0))
