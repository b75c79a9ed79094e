"""The building blocks of the decoders in `tandem.models`: linear (with weight loaders), norm,
rotary, attention and activation layers, each with an unfused torch path (any device) and the
fused Triton kernels of `tandem.models.triton_ops` where a layer is built with `fused=True`
(CUDA only). `triton_ops` is None where Triton is not installed: only the torch path exists.
"""

from __future__ import annotations

try:
    from tandem.models import triton_ops
except ImportError:  # no triton: only the unfused torch path exists
    triton_ops = None
