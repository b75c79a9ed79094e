"""The eager forward's input upload: values intact, every part 16-byte aligned (Triton compiles
kernel variants by pointer alignment), buffers reused and grown across steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.executor.input_staging import InputStaging


def check_upload(staging: InputStaging, step: int) -> None:
    rng = np.random.default_rng(step)
    int64_parts = [rng.integers(0, 1 << 40, size) for size in (3 + step, 1, 7, 0, 5)]
    int32_parts = [rng.integers(0, 1 << 20, size) for size in (2, 9 + step, 1)]
    uploaded = staging.upload({torch.int64: int64_parts, torch.int32: int32_parts})
    for dtype, parts in ((torch.int64, int64_parts), (torch.int32, int32_parts)):
        assert len(uploaded[dtype]) == len(parts)
        for tensor, expected in zip(uploaded[dtype], parts, strict=True):
            assert tensor.dtype == dtype and tensor.device == staging.device
            assert tensor.storage_offset() * tensor.element_size() % 16 == 0
            assert tensor.data_ptr() % 16 == 0
            assert tensor.cpu().tolist() == expected.tolist()


def test_parts_arrive_whole_and_aligned_on_cpu():
    staging = InputStaging(torch.device("cpu"))
    for step in range(3):
        check_upload(staging, step)


@pytest.mark.cuda
def test_parts_arrive_whole_and_aligned_on_cuda():
    staging = InputStaging(torch.device("cuda", 0))
    for step in range(3):
        check_upload(staging, step)
    first_buffer = staging.buffers[torch.int64]
    check_upload(staging, 4)
    assert staging.buffers[torch.int64] is first_buffer  # reused, not pinned again
    big = [np.arange(10_000)]
    (tensor,) = staging.upload({torch.int64: big})[torch.int64]
    assert tensor.cpu().tolist() == big[0].tolist()  # grown past the first buffer
