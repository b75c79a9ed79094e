"""Test-only KV fault injection for `tandem worker` subprocesses: with this directory on
PYTHONPATH and TANDEM_TEST_KV_FAULT set to a `TransportFault.parse` text ("drop:1", "delay:5"),
the worker's TCP KV server injects that fault into its fetches.

Nothing is imported or patched until the KV server's module is (a meta path hook replaces its
server class with the faulty subclass then), so every process that never serves KV runs
unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "tandem.kv.control.server"
SERVER_CLASS = "KVServer"


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds TARGET with the other finders and swaps in the faulty server once it has run."""

    def __init__(self, fault_text: str) -> None:
        self.fault_text = fault_text

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            from transport_faults import TransportFault, faulty

            fault = TransportFault.parse(self.fault_text)
            setattr(module, SERVER_CLASS, faulty(getattr(module, SERVER_CLASS), fault))

        spec.loader.exec_module = exec_module
        return spec


if value := os.environ.get("TANDEM_TEST_KV_FAULT"):
    sys.meta_path.insert(0, PatchOnImport(value))
