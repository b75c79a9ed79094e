"""The per-rank read fault of the fault plug-in (TANDEM_TEST_RANK_READ_FAULT set): every nixl or
mooncake read that a tensor-parallel rank other than 0 makes (a `tandem.executor.rank_worker`
process) fails as a broken connection does; rank 0's reads run unchanged."""

from __future__ import annotations

import sys


def install(registered_module) -> None:
    plane = registered_module.RegisteredMemoryPlane
    read = plane._read

    def failing_read(self, handle, *args) -> None:
        if not sys.argv[0].endswith("rank_worker.py"):
            read(self, handle, *args)
            return
        from tandem.kv.errors import KVTransferError

        handle.fail(KVTransferError("connection", "a test fault broke this rank's read"))

    plane._read = failing_read
