"""A row-parallel projection's sum over the ranks fused with the residual add and RMSNorm after
it, in one kernel over peer memory (CUDA, a decode step's few rows):

    residual += sum over ranks of x;  out = w * rms_norm(residual)

with the numbers of `all_reduce` then `triton_ops.add_rms_norm` (the sum in fp32 in rank order,
rounded once; every rank gets the same bits). Where a decode layer ran a one-shot all-reduce
and a norm kernel, it runs this one, on groups of up to four ranks (`FUSED_ADD_NORM_MAX_RANKS`
in group.py).

How the ranks meet: every rank maps one buffer of every other (torch's symmetric memory), whose
slots hold EMPTY (negative zero's bits) wherever no value is waiting. A call writes this rank's
rows into its own slot of every other rank's buffer (a negative zero goes as a positive one),
then reads the other ranks' slots of its own buffer until no element is EMPTY, sums them with
its own rows in rank order, and writes EMPTY back: the values are their own flags, so no fence
or flag round trip stands between a rank's write and its peer's read. The grid is always
PROGRAMS programs, program p taking rows p, p + PROGRAMS, ..., with its own call count (the
ranks make the same calls, so the counts agree; all the warps of a program take its value from
one atomic, relaxed: kernel boundaries order the calls).
Calls alternate between two sets of slots: a peer writes a set again two calls later, after it
has read this rank's rows of the call between, which this rank wrote only after its kernel
that emptied the set had ended. So the kernel is captured in CUDA graphs like any other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.pdl import pdl_options, wait_for_previous

PROGRAMS = 128
MAX_WIDTH = 16384
# an element's bits, and EMPTY's, by the element's size
BITS = {2: (torch.int16, tl.int16, -(1 << 15)), 4: (torch.int32, tl.int32, -(1 << 31))}


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    buffers_ptr,  # int64 [ranks]: each rank's buffer, mapped here
    calls_ptr,  # int64 [PROGRAMS]: this rank's call count of each program
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    width,
    x_stride,
    residual_stride,
    eps,
    rank,
    slot_elements,
    RANKS: tl.constexpr,
    RANKS_POW2: tl.constexpr,
    PROGRAMS: tl.constexpr,
    BITS: tl.constexpr,
    EMPTY: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    dtype = x_ptr.dtype.element_ty
    # loads go out ahead of what precedes their use: the addresses, the first row and the norm's
    # weight overlap the call count's atomic; each next row, the stores of the row before
    ranks = tl.arange(0, RANKS_POW2)
    addresses = tl.load(buffers_ptr + ranks, mask=ranks < RANKS, other=0)
    first = tl.zeros_like(cols) + program  # the row, for every column: the mask's shape
    x_row = tl.load(x_ptr + program * x_stride + cols, mask=mask & (first < num_rows))
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # one atomic, its value broadcast to the program's warps: a load and a store here let a
    # warp that read late see the count another warp had already raised, and take the other
    # slot set for its part of the row (the ranks then wait on each other for ever)
    call = tl.atomic_add(calls_ptr + program, 1, sem="relaxed") + 1
    parity = call % 2
    # write this rank's rows into its slot of every other rank's buffer
    for row in range(program, num_rows, PROGRAMS):
        values = _sent(x_row, BITS, EMPTY)
        next_row = tl.zeros_like(cols) + (row + PROGRAMS)
        x_row = tl.load(x_ptr + next_row * x_stride + cols, mask=mask & (next_row < num_rows))
        for peer in tl.static_range(RANKS):
            if peer != rank:
                slots = _address(addresses, ranks, peer).to(tl.pointer_type(BITS))
                slot = slots + (parity * RANKS + rank) * slot_elements
                tl.store(slot + row * width + cols, values, mask=mask)
    own = _address(addresses, ranks, rank).to(tl.pointer_type(BITS))
    own += parity * RANKS * slot_elements
    empty = tl.full([BLOCK], EMPTY, BITS)
    for row in range(program, num_rows, PROGRAMS):
        residual_row = residual_ptr + row * residual_stride + cols
        residual = tl.load(residual_row, mask=mask, other=0.0)  # in flight while it waits
        own_row = _sent(tl.load(x_ptr + row * x_stride + cols, mask=mask), BITS, EMPTY)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(RANKS):  # in rank order, this rank's row from its input
            if peer == rank:
                part = own_row
            else:
                slot = own + peer * slot_elements + row * width + cols
                part = tl.load(slot, mask=mask, other=0, volatile=True)
                while tl.sum((part == EMPTY).to(tl.int32), axis=0) > 0:
                    part = tl.load(slot, mask=mask, other=0, volatile=True)
                tl.store(slot, empty, mask=mask)
            total += part.to(dtype, bitcast=True).to(tl.float32)
        summed = (total.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_row, summed, mask=mask)
        values = summed.to(tl.float32)
        variance = tl.sum(values * values, axis=0) / width
        normed = (values * tl.rsqrt(variance + eps)).to(dtype)
        out = weight * normed.to(tl.float32)
        tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sent(row, BITS: tl.constexpr, EMPTY: tl.constexpr):
    """A row's bits as sent: a negative zero (EMPTY's bits) as a positive one."""
    values = row.to(BITS, bitcast=True)
    return tl.where(values == EMPTY, tl.zeros_like(values), values)


@triton.jit
def _address(addresses, ranks, rank):
    """Rank `rank`'s buffer address, out of all of them in registers."""
    return tl.sum(tl.where(ranks == rank, addresses, 0), axis=0)


class AllReduceAddRMSNorm:
    """The fused sum, add and norm of one tensor-parallel group, for tensors of `dtype` up to
    the buffer's slot size. Joined collectively (every rank at once) on a registered group."""

    @staticmethod
    def allocate(
        size: int, max_bytes: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A rank's buffer for sums of up to max_bytes of `dtype`: two sets of a slot a rank,
        every element EMPTY."""
        import torch.distributed._symmetric_memory as symm_mem

        if dtype.itemsize not in BITS:
            raise RuntimeError(f"the fused all-reduce takes 2- and 4-byte elements, not {dtype}")
        bits, _, empty = BITS[dtype.itemsize]
        buffer = symm_mem.empty(2 * size * max_bytes // dtype.itemsize, dtype=bits, device=device)
        buffer.fill_(empty)
        torch.cuda.synchronize(device)
        return buffer

    def __init__(
        self, group_name: str, rank: int, size: int, dtype: torch.dtype, buffer: torch.Tensor
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.size, self.dtype = rank, size, dtype
        self.slot_elements = buffer.numel() // (2 * size)
        self.max_bytes = self.slot_elements * dtype.itemsize
        self.buffer = buffer  # the memory the other ranks map lives as long as this does
        # collective: no rank's first row lands before every rank has emptied its own slots
        self.handle = symm_mem.rendezvous(buffer, group_name)
        offset = buffer.data_ptr() - self.handle.buffer_ptrs[rank]  # the same on every rank
        addresses = [pointer + offset for pointer in self.handle.buffer_ptrs]
        self.buffers = torch.tensor(addresses, dtype=torch.int64, device=buffer.device)
        self.calls = torch.zeros(PROGRAMS, dtype=torch.int64, device=buffer.device)

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == self.dtype
            and x.dim() == 2
            and x.stride(1) == 1
            and x.shape[1] <= MAX_WIDTH
            and x.shape[0] * x.shape[1] * x.element_size() <= self.max_bytes
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x: this rank's partial sums [T, width]; residual [T, width] (updated in place)."""
        rows, width = x.shape
        out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
        _, bits, empty = BITS[x.element_size()]
        _all_reduce_add_rms_norm_kernel[(PROGRAMS,)](
            self.buffers, self.calls, x, residual, weight, out, rows, width, x.stride(0),
            residual.stride(0), eps, self.rank, self.slot_elements, RANKS=self.size,
            RANKS_POW2=triton.next_power_of_2(self.size), PROGRAMS=PROGRAMS, BITS=bits,
            EMPTY=empty, BLOCK=triton.next_power_of_2(width), **pdl_options(x.device),
        )  # fmt: skip
        return out
