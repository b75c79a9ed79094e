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
        """The given arrays on the device, as flat tensors of their dtype (reshape as needed)."""
        if self.buffers_free is not None:
            self.buffers_free.synchronize()
        uploaded = {}
        for dtype, arrays in parts.items():
            flat_arrays = [np.asarray(a, dtype=NUMPY_DTYPES[dtype]).ravel() for a in arrays]
            sizes = [a.size for a in flat_arrays]
            total = sum(sizes)
            if not self.pinned:
                flat = torch.from_numpy(np.concatenate(flat_arrays))
            else:
                buffer = self.buffers.get(dtype)
                if buffer is None or buffer.numel() < total:
                    size = max(total, 2 * buffer.numel() if buffer is not None else 4096)
                    buffer = torch.empty(size, dtype=dtype, pin_memory=True)
                    self.buffers[dtype] = buffer
                np.concatenate(flat_arrays, out=buffer.numpy()[:total])
                flat = buffer[:total].to(self.device, non_blocking=True)
            uploaded[dtype] = list(flat.split(sizes))
        if self.buffers_free is not None:
            self.buffers_free.record()
        return uploaded
