"""The building blocks of the decoders in `tandem.models`: linear (with weight loaders), norm,
rotary, attention and activation layers, each with an unfused torch path (any device) and the
fused Triton kernels of `tandem.models.triton_ops` where a layer is built with `fused=True`
(CUDA only). `fused_kernels()` imports that module on first use (Triton takes about 0.4 s to
import, which an engine on the CPU never needs), or gives None where Triton is not installed.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def fused_kernels() -> ModuleType | None:
    try:
        from tandem.models import triton_ops
    except ImportError:  # no triton: only the unfused torch path exists
        return None
    return triton_ops
