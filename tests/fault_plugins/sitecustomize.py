"""Test-only fault injection for `tandem worker` subprocesses (and their tensor-parallel ranks):
with this directory on PYTHONPATH, each variable set turns on its fault.

    TANDEM_TEST_FAULT=where:token_id[,...]  the engine raises for such prompts (engine_faults.py)
    TANDEM_TEST_KV_FAULT=drop:1 | delay:5   the TCP KV server injects that fault into its fetches
                                            (transport_faults.py: `TransportFault.parse`)
    TANDEM_TEST_RANK_READ_FAULT=1           every nixl or mooncake read of a rank other than 0
                                            fails (rank_read_faults.py)

Nothing is imported or patched until the module a fault targets is (a meta path hook patches it
right after it has run), so every process that never imports it runs unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds `target` with the other finders and calls patch(module) once the module has run."""

    def __init__(self, target: str, patch: Callable) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def faulty_kv_server(module, fault_text: str) -> None:
    from transport_faults import TransportFault, faulty

    module.KVServer = faulty(module.KVServer, TransportFault.parse(fault_text))


if value := os.environ.get("TANDEM_TEST_FAULT"):
    from engine_faults import install, parse_faults

    faults = parse_faults(value)
    sys.meta_path.insert(0, PatchOnImport("tandem.engine.core", lambda m: install(m, faults)))
if kv_fault := os.environ.get("TANDEM_TEST_KV_FAULT"):
    patch_server = lambda module: faulty_kv_server(module, kv_fault)  # noqa: E731
    sys.meta_path.insert(0, PatchOnImport("tandem.kv.control.server", patch_server))
if os.environ.get("TANDEM_TEST_RANK_READ_FAULT"):
    from rank_read_faults import install as fail_rank_reads

    sys.meta_path.insert(0, PatchOnImport("tandem.kv.data.registered", fail_rank_reads))
