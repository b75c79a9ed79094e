"""Test-only fault for the per-rank KV reads: with this directory on PYTHONPATH and
TANDEM_TEST_RANK_READ_FAULT set, every nixl or mooncake read that a tensor-parallel rank other
than 0 makes (a `tandem.executor.rank_worker` process) fails as a broken connection does.

Nothing is imported or patched until the planes' shared module is (a meta path hook wraps its
read then), so rank 0 and every process that reads no KV run unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "tandem.kv.data.registered"


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds TARGET with the other finders and wraps its read once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            plane = module.RegisteredMemoryPlane
            read = plane._read

            def failing_read(self, handle, *args) -> None:
                if not sys.argv[0].endswith("rank_worker.py"):
                    read(self, handle, *args)
                    return
                from tandem.kv.errors import KVTransferError

                handle.fail(KVTransferError("connection", "a test fault broke this rank's read"))

            plane._read = failing_read

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TANDEM_TEST_RANK_READ_FAULT"):
    sys.meta_path.insert(0, PatchOnImport())
