"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

On Hopper and later GPUs a kernel launched with PDL is scheduled while the kernel before it in
the stream is still running; it must wait (`griddepcontrol.wait`) before it reads or writes
memory, and it lets the next kernel launch early in turn. A decode step is a chain of a few
hundred short kernels, and this overlaps each one's launch latency with the previous one's tail.
A kernel joins by taking a `USE_PDL` constexpr, calling `wait_for_previous(USE_PDL)` before its
first memory access, and being launched with `**pdl_options(device)`.
Kernels launched without PDL (torch's, cuBLAS's) wait for everything before them as usual.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch keywords of a kernel that takes part: its USE_PDL constexpr and Triton's launch_pdl
    option, both on for Hopper and later GPUs (pass them as `**pdl_options(device)`)."""
    on = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible, then let the next
    kernel launch (it waits in turn, so finishing in order still holds down the chain)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
