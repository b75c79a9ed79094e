"""What the prefill's KV server keeps per transfer and per handoff (`server.py` changes them,
under its lock, from the engine's thread and the connections' threads)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Handoff:
    arrived: threading.Event = field(default_factory=threading.Event)
    message: dict[str, Any] | None = None
    expires: float = float("inf")  # what was announced is dropped after this
    waiter: socket.socket | None = None  # the connection of a decode worker waiting on it
    answered: bool = False  # the waiter got its one answer (set by whoever sends it)
    transfer_id: str | None = None  # the transfer the announcement names, to hold if asked
    hold_wanted: bool = False  # the waiter asked for that transfer held (AWAIT hold)
    held: bool = False  # it is held for the waiter's connection, until CONFIRM or a drop

    @classmethod
    def renewed(cls, previous: Handoff | None) -> Handoff:
        """The record of a new wait: what `previous` (another wait's, whose client may come
        again after its connection broke) had announced or kept, none of that wait's state."""
        handoff = cls()
        if previous is not None:
            handoff.message, handoff.transfer_id = previous.message, previous.transfer_id
            handoff.expires = previous.expires
            if previous.message is not None:
                handoff.arrived.set()
        return handoff


@dataclass(eq=False)
class Transfer:
    layers: list[memoryview]
    # each layer's (parts, blocks) when it is [parts, blocks, ...] (a fetch may start at a
    # block), else None (it is served whole)
    block_shapes: list[tuple[int, int] | None]
    wait_layer: Callable[[int], None] | None
    withdrawn: threading.Event = field(default_factory=threading.Event)
    holds: int = 0  # connections that hold it (a broken one may have come again meanwhile)
    # what the client that confirms it got: (the bytes its fetch sent, the blocks it got or
    # read in place), None where not known
    served: tuple[int | None, int | None] = (None, None)
