"""The head-range arithmetic of the per-rank KV reads (kv/connector/rank_reads.py): which
prefill ranks, and which of their KV heads, each decode rank reads, against ranges worked out by
hand for prefill and decode sizes in {1, 2, 4} and 1, 2, 4 or 8 KV heads (replicated heads: the
first rank holding one serves it); and the plane reads a decode rank starts from them.
"""

from __future__ import annotations

import pytest
import torch

from tandem.kv.connector.rank_reads import plan_head_reads, start_rank_reads
from tandem.kv.connector.ranks import RankLayout
from tandem.kv.data.base import DataPlane, ReadHandle
from tandem.kv.errors import KVTransferError
from tandem.kv.params import KVTransferParams, RankExport

# (KV heads, prefill size, decode size) -> per decode rank: [(prefill rank, (start, stop)), ...]
BY_HAND = {
    (1, 1, 1): [[(0, (0, 1))]],
    (1, 1, 4): [[(0, (0, 1))]] * 4,
    (1, 2, 1): [[(0, (0, 1))]],  # both prefill ranks hold head 0: rank 0 serves it
    (1, 4, 2): [[(0, (0, 1))]] * 2,
    (2, 1, 2): [[(0, (0, 1))], [(0, (1, 2))]],
    (2, 2, 1): [[(0, (0, 1)), (1, (1, 2))]],
    (2, 2, 2): [[(0, (0, 1))], [(1, (1, 2))]],
    (2, 1, 4): [[(0, (0, 1))], [(0, (0, 1))], [(0, (1, 2))], [(0, (1, 2))]],
    (2, 4, 1): [[(0, (0, 1)), (2, (1, 2))]],  # ranks 0, 1 hold head 0; ranks 2, 3 head 1
    (2, 4, 2): [[(0, (0, 1))], [(2, (1, 2))]],
    (2, 4, 4): [[(0, (0, 1))], [(0, (0, 1))], [(2, (1, 2))], [(2, (1, 2))]],
    (4, 1, 1): [[(0, (0, 4))]],
    (4, 1, 2): [[(0, (0, 2))], [(0, (2, 4))]],
    (4, 2, 1): [[(0, (0, 2)), (1, (2, 4))]],
    (4, 2, 4): [[(0, (0, 1))], [(0, (1, 2))], [(1, (2, 3))], [(1, (3, 4))]],
    (4, 4, 2): [[(0, (0, 1)), (1, (1, 2))], [(2, (2, 3)), (3, (3, 4))]],
    (4, 4, 4): [[(0, (0, 1))], [(1, (1, 2))], [(2, (2, 3))], [(3, (3, 4))]],
    (8, 1, 4): [[(0, (0, 2))], [(0, (2, 4))], [(0, (4, 6))], [(0, (6, 8))]],
    (8, 2, 4): [[(0, (0, 2))], [(0, (2, 4))], [(1, (4, 6))], [(1, (6, 8))]],
    (8, 4, 1): [[(0, (0, 2)), (1, (2, 4)), (2, (4, 6)), (3, (6, 8))]],
    (8, 4, 2): [[(0, (0, 2)), (1, (2, 4))], [(2, (4, 6)), (3, (6, 8))]],
    (8, 2, 2): [[(0, (0, 4))], [(1, (4, 8))]],
}


def ranges(num_kv_heads: int, size: int) -> list[tuple[int, int]]:
    layout = RankLayout.of(num_kv_heads, size)
    return [(start, start + layout.count) for start in layout.starts]


@pytest.mark.parametrize(("num_kv_heads", "prefill_size", "decode_size"), list(BY_HAND))
def test_each_decode_rank_reads_the_ranges_worked_out_by_hand(
    num_kv_heads, prefill_size, decode_size
):
    sources = ranges(num_kv_heads, prefill_size)
    planned = [plan_head_reads(sources, local) for local in ranges(num_kv_heads, decode_size)]
    assert planned == BY_HAND[(num_kv_heads, prefill_size, decode_size)]


def test_a_head_no_prefill_rank_holds_is_a_mismatch():
    with pytest.raises(KVTransferError) as raised:
        plan_head_reads([(0, 1)], (0, 2))
    assert raised.value.kind == "mismatch"


class RecordingPlane(DataPlane):
    """Records the reads it is asked for and ends each at once (the second one failed when
    `fail_second`)."""

    reads_in_place = True
    export_fields = ("kv_memory_handle",)

    def __init__(self, fail_second: bool = False) -> None:
        super().__init__(torch.device("cpu"), 1.0, None, lambda: None)
        self.fail_second = fail_second
        self.sources = []

    def start_read(self, source, local_block_ids, first_block, on_done=None):
        self.sources.append((source, local_block_ids, first_block))
        read = ReadHandle(on_done)
        if self.fail_second and len(self.sources) == 2:
            read.fail(KVTransferError("connection", "broken"))
        else:
            read.finish(100)
        return read


def prefill_params(num_ranks: int) -> KVTransferParams:
    exports = [RankExport(rank, 1, kv_memory_handle=f"handle-{rank}") for rank in range(num_ranks)]
    return KVTransferParams(
        remote_engine_id="prefill", remote_request_id="lease", remote_block_ids=[7, 8, 9],
        remote_host="10.0.0.1", remote_port=4000, tp_size=num_ranks, kv_layout="2x2x2x8:float32",
        kv_rank_exports=exports,
    )  # fmt: skip


def test_a_one_rank_decode_reads_each_prefill_rank_s_heads():
    plane = RecordingPlane()
    plane.register_kv_cache(torch.zeros(2, 2, 6, 4, 2, 8))  # all 2 KV heads
    read = start_rank_reads(plane, prefill_params(2), [3, 4], 1, 2)
    assert read.done() and read.result() == 200
    assert [
        (s.kv_heads, s.read_heads, s.exported, s.block_ids, ids, first)
        for s, ids, first in plane.sources
    ] == [
        ((0, 1), (0, 1), {"kv_memory_handle": "handle-0"}, [7, 8, 9], [3, 4], 1),
        ((1, 2), (1, 2), {"kv_memory_handle": "handle-1"}, [7, 8, 9], [3, 4], 1),
    ]
    # the one-rank params of a one-rank prefill: one read of every head
    plane.sources.clear()
    single = KVTransferParams(remote_block_ids=[1, 2], kv_memory_handle="whole")
    start_rank_reads(plane, single, [0, 1], 0, 2)
    assert [(s.kv_heads, s.read_heads, s.exported) for s, _, _ in plane.sources] == [
        ((0, 2), (0, 2), {"kv_memory_handle": "whole"})
    ]


def test_a_part_that_fails_fails_the_read_once_every_part_ended():
    plane = RecordingPlane(fail_second=True)
    plane.register_kv_cache(torch.zeros(2, 2, 6, 4, 2, 8))
    read = start_rank_reads(plane, prefill_params(2), [3], 0, 2)
    assert read.done() and len(plane.sources) == 2
    with pytest.raises(KVTransferError):
        read.result()
