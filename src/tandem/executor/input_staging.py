"""One upload per dtype for the eager forward pass's integer inputs.

A step's inputs (token ids, positions, slots, block tables, ...) are built on the host as numpy
arrays. On CUDA they are packed into pinned host buffers that live as long as the runner and go
up in one asynchronous copy per dtype; pinning fresh tensors every step cost more host time than
the copies themselves. On CPU the packed arrays are used as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}
ALIGNMENT = 16  # bytes


class InputStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        # The previous step's copies have left the buffers (set after every upload).
        self.buffers_free = torch.cuda.Event() if self.pinned else None

    def upload(
        self, parts: dict[torch.dtype, Sequence[Sequence[int] | np.ndarray]]
    ) -> dict[torch.dtype, list[torch.Tensor]]:
        """The given arrays on the device, as flat tensors of their dtype (reshape as needed),
        each starting on a 16-byte boundary."""
        if self.buffers_free is not None:
            self.buffers_free.synchronize()
        uploaded = {}
        for dtype, arrays in parts.items():
            flat_arrays = [np.asarray(a, dtype=NUMPY_DTYPES[dtype]).ravel() for a in arrays]
            # Each part starts on a 16-byte boundary: Triton specializes a kernel on whether its
            # pointers are 16-byte aligned, and an offset that changed from step to step would
            # compile new variants of the kernels that read these inputs.
            per_line = ALIGNMENT // np.dtype(NUMPY_DTYPES[dtype]).itemsize
            offsets, total = [], 0
            for array in flat_arrays:
                offsets.append(total)
                total += -(-array.size // per_line) * per_line
            if self.pinned:
                buffer = self.buffers.get(dtype)
                if buffer is None or buffer.numel() < total:
                    size = max(total, 2 * buffer.numel() if buffer is not None else 4096)
                    buffer = torch.empty(size, dtype=dtype, pin_memory=True)
                    self.buffers[dtype] = buffer
                host = buffer.numpy()
            else:
                host = np.empty(total, dtype=NUMPY_DTYPES[dtype])
            for offset, array in zip(offsets, flat_arrays, strict=True):
                host[offset : offset + array.size] = array
            if self.pinned:
                flat = buffer[:total].to(self.device, non_blocking=True)
            else:
                flat = torch.from_numpy(host)
            uploaded[dtype] = [
                flat[offset : offset + array.size]
                for offset, array in zip(offsets, flat_arrays, strict=True)
            ]
        if self.buffers_free is not None:
            self.buffers_free.record()
        return uploaded
