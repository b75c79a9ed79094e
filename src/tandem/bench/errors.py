"""The one exception type of `tandem bench`: a problem the user can fix, shown without traceback."""

from __future__ import annotations


class BenchError(Exception):
    """Bad flags, an unreachable server, a cluster that would not start: says what to change."""
