"""Processes that must not outlive the process that started them (the launcher's children, a
worker's engine core): on Linux the kernel kills such a process when its parent dies."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux; strictly, when the thread
    that started it ends); exit now if the parent died already."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
