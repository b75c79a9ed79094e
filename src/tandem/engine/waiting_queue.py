"""The scheduler's waiting requests, in the order it takes them (`--scheduling-policy`).

* `fcfs`: arrival order; a request sent back (preempted, or its remote KV loaded) goes first.
* `priority` (vLLM's): lower `priority` first, then arrival order; a request sent back takes its
  place by the same rule (its arrival is its first one).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tandem.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def urgency(request: Request) -> tuple[int, float]:
    """The priority policy's order: smaller first."""
    return request.sampling_params.priority, request.arrival_time


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}")
        self.by_priority = policy == "priority"
        self._requests: deque[Request] = deque()

    def append(self, request: Request) -> None:
        """A new request."""
        if self.by_priority:
            self._insert(request)
        else:
            self._requests.append(request)

    def appendleft(self, request: Request) -> None:
        """A request sent back to wait again."""
        if self.by_priority:
            self._insert(request)
        else:
            self._requests.appendleft(request)

    def _insert(self, request: Request) -> None:
        key = urgency(request)
        index = next(
            (i for i, queued in enumerate(self._requests) if urgency(queued) > key),
            len(self._requests),
        )
        self._requests.insert(index, request)

    def popleft(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: object) -> bool:
        return request in self._requests
