"""The processes below a test's launcher or actor, read from /proc (Linux)."""

from __future__ import annotations

from pathlib import Path


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
