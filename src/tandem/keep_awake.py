"""Keeps a server's asyncio loop polling instead of sleeping while it serves requests.

An event loop with nothing to do blocks in `epoll_wait`, and on hosts whose idle cores drop into
a deep sleep state each wake-up (a request arriving, an engine output, a worker's answer) costs
a few hundred microseconds. A request through PD crosses four such loops. `KeepAwake` wraps an
ASGI app: while a request is in flight, and for `linger_s` after the last one ended, a task
yields to the loop over and over, so the loop polls its sockets with a zero timeout and never
sleeps. It costs one core per process while it spins; `linger_s` 0 turns it off.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Receive, Scope, Send


class KeepAwake:
    """ASGI middleware: no sleeping loop while HTTP requests are served (and `linger_s` after)."""

    def __init__(self, app: ASGIApp, linger_s: float) -> None:
        if linger_s < 0:
            raise ValueError("linger_s must be 0 or more")
        self.app = app
        self.linger_s = linger_s
        self._in_flight = 0
        self._awake_until = 0.0
        self._spinner: asyncio.Task[None] | None = None

    @property
    def spinning(self) -> bool:
        return self._spinner is not None and not self._spinner.done()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.linger_s == 0:
            await self.app(scope, receive, send)
            return
        self._in_flight += 1
        if not self.spinning:
            self._spinner = asyncio.ensure_future(self._spin())
        try:
            await self.app(scope, receive, send)
        finally:
            self._in_flight -= 1
            self._awake_until = time.monotonic() + self.linger_s

    async def _spin(self) -> None:
        while self._in_flight or time.monotonic() < self._awake_until:
            await asyncio.sleep(0)
