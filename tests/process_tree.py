"""A test's tandem processes: one started in a session of its own, and the processes below a
launcher or an actor, read from /proc (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def tandem_process(log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m tandem.cli ARGS` in its own session (a group to signal), output to `log`;
    `env` adds to or replaces variables of its environment."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def children_of(pid: int) -> set[int]:
    return {
        int(child)
        for task in Path(f"/proc/{pid}/task").glob("*/children")
        for child in task.read_text().split()
    }


def descendants(pid: int) -> set[int]:
    """Every process below pid: a launcher's workers and their engine cores."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        children = children_of(frontier.pop()) - found
        frontier.extend(children)
        found |= children
    return found


def alive(pid: int) -> bool:
    """pid runs (a zombie does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
