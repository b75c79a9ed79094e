"""KeepAwake: while a request is in flight and for its linger time after, the event loop polls
without sleeping (its thread keeps a CPU busy); otherwise the loop sleeps as usual, and the
wrapped app sees every call unchanged. Also how the worker, the router and `tandem serve` set it."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from tandem.engine.config import BUSY_POLL_CUDA_S, EngineConfig
from tandem.keep_awake import KeepAwake
from tandem.router import cli as router_cli
from tandem.router.config import RouterConfig

HTTP_SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions"}
IDLE_S = 0.2


async def cpu_share_while_idle() -> float:
    """The share of a core this thread uses while its coroutine sleeps for IDLE_S."""
    wall, cpu = time.monotonic(), time.thread_time()
    await asyncio.sleep(IDLE_S)
    return (time.thread_time() - cpu) / (time.monotonic() - wall)


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
        assert await cpu_share_while_idle() < 0.1  # nothing in flight yet: the loop sleeps
        request = asyncio.ensure_future(awake(HTTP_SCOPE, noop_receive, send))
        assert await cpu_share_while_idle() > 0.25  # in flight: it polls all along
        assert awake.spinning
        app.release.set()
        await request
        assert sent == [{"type": "http.response.start", "status": 200, "headers": []}]
        assert awake.spinning  # the linger
        await asyncio.sleep(0.3)
        assert not awake.spinning
        assert await cpu_share_while_idle() < 0.1

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
