"""KeepAwake: while a request is in flight and for its linger time after, the event loop polls
without sleeping (it waits on its sockets with a timeout of 0); otherwise the loop sleeps as
usual, and the wrapped app sees every call unchanged. Also how the worker, the router and
`tandem serve` set it."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tandem.engine.config import BUSY_POLL_CUDA_S, EngineConfig
from tandem.keep_awake import KeepAwake
from tandem.router import cli as router_cli
from tandem.router.config import RouterConfig

HTTP_SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions"}
IDLE_S = 0.2


async def waits_while_idle() -> list[float | None]:
    """The timeouts the running loop waits on its sockets with while this coroutine sleeps for
    IDLE_S: only 0 where it polls without sleeping, one of about IDLE_S where it sleeps (how
    much CPU spinning takes is the operating system's, and on a loaded machine not this test's
    to tell)."""
    selector = asyncio.get_running_loop()._selector
    timeouts: list[float | None] = []
    select = selector.select

    def recording_select(timeout=None):
        timeouts.append(timeout)
        return select(timeout)

    selector.select = recording_select
    try:
        await asyncio.sleep(IDLE_S)
    finally:
        selector.select = select
    return timeouts


def polls_without_sleeping(timeouts: list[float | None]) -> bool:
    return len(timeouts) > 1 and set(timeouts) == {0}


def sleeps(timeouts: list[float | None]) -> bool:
    return any(timeout is None or timeout > IDLE_S / 2 for timeout in timeouts)


class SlowApp:
    """An ASGI app whose HTTP answer waits for `release`; it records what it was called with."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        self.calls.append(scope["type"])
        if scope["type"] == "http":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})


async def noop_receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


def test_the_loop_spins_while_a_request_is_in_flight_and_for_the_linger_after():
    async def scenario() -> None:
        app = SlowApp()
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        awake = KeepAwake(app, linger_s=0.3)
        assert sleeps(await waits_while_idle())  # nothing in flight yet: the loop sleeps
        request = asyncio.ensure_future(awake(HTTP_SCOPE, noop_receive, send))
        assert polls_without_sleeping(await waits_while_idle())  # in flight: all along
        assert awake.spinning
        app.release.set()
        await request
        assert sent == [{"type": "http.response.start", "status": 200, "headers": []}]
        assert awake.spinning  # the linger
        await asyncio.sleep(0.3)
        assert not awake.spinning
        assert sleeps(await waits_while_idle())

    asyncio.run(scenario())


def test_no_spinning_when_off_or_outside_http():
    async def scenario() -> None:
        app = SlowApp()
        app.release.set()
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        off = KeepAwake(app, linger_s=0.0)
        await off(HTTP_SCOPE, noop_receive, send)
        assert not off.spinning
        on = KeepAwake(app, linger_s=5.0)
        await on({"type": "lifespan"}, noop_receive, send)
        assert not on.spinning
        assert app.calls == ["http", "lifespan"] and len(sent) == 2

    asyncio.run(scenario())


def test_the_linger_is_checked():
    with pytest.raises(ValueError, match="linger_s"):
        KeepAwake(SlowApp(), linger_s=-1.0)
    with pytest.raises(ValueError, match="busy_poll_s"):
        RouterConfig(busy_poll_s=-1.0)


def test_the_worker_loop_follows_the_engine_setting_without_touching_cuda():
    assert EngineConfig(device="cpu").busy_poll_seconds() == 0.0
    assert EngineConfig(device="cuda:1").busy_poll_seconds() == BUSY_POLL_CUDA_S
    assert EngineConfig(device="cuda", busy_poll_s=0.0).busy_poll_seconds() == 0.0
    assert EngineConfig(device="cpu", busy_poll_s=0.5).busy_poll_seconds() == 0.5


def test_the_router_loop_is_off_unless_asked():
    parser = argparse.ArgumentParser()
    router_cli.add_parser(parser.add_subparsers())
    default = router_cli.config_from_args(parser.parse_args(["router"]))
    assert default.busy_poll_s == 0.0
    asked = router_cli.config_from_args(parser.parse_args(["router", "--busy-poll-s", "2"]))
    assert asked.busy_poll_s == 2.0
