"""The server extension's push of its metrics to gpulab-metrics, against a real HTTP receiver."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from tornado import web
from tornado.httpserver import HTTPServer

from jupyterlab_gpulab.push import MetricsPusher, push_settings_from_env
from tests.harness.ports import free_port


@dataclass
class Receiver:
    """What the service's push endpoint saw, and how it answers."""

    url: str = ""
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)  # path, Authorization, body
    status: int = 202
    hang: bool = False


class PushHandler(web.RequestHandler):
    async def post(self, path: str) -> None:
        receiver: Receiver = self.settings["receiver"]
        receiver.seen.append(
            (path, self.request.headers.get("Authorization", ""), self.request.body)
        )
        if receiver.hang:
            await asyncio.Event().wait()
        self.set_status(receiver.status)
        self.finish("refused: not yours" if receiver.status >= 300 else "{}")


class RedirectHandler(web.RequestHandler):
    def post(self, path: str) -> None:
        self.redirect(f"/elsewhere/{path}", status=307)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    app = web.Application(
        [(r"/api/push/(.*)", PushHandler), (r"/moved/(.*)", RedirectHandler)], receiver=r
    )
    port = free_port()
    server = HTTPServer(app)
    server.listen(port, "127.0.0.1")
    r.url = f"http://127.0.0.1:{port}"
    try:
        yield r
    finally:
        server.stop()


def pusher(url: str, server: str = "train", interval: float = 0.05, **kw: float) -> MetricsPusher:
    p = MetricsPusher(url, "server-token", "ada", server, lambda: b"gpulab_x 1\n", interval, **kw)
    p.start(asyncio.get_running_loop())
    p.task.cancel()  # the tests drive push_once themselves
    return p


async def test_a_push_carries_the_servers_own_token_to_its_user_and_server_path(
    receiver: Receiver,
) -> None:
    p = pusher(f"{receiver.url}/api/push")
    assert await p.push_once()
    assert receiver.seen == [("ada/train", "token server-token", b"gpulab_x 1\n")]
    default = pusher(f"{receiver.url}/api/push/", server="")
    assert await default.push_once()
    assert receiver.seen[-1][0] == "ada"
    p.stop()
    default.stop()


async def test_failures_are_logged_once_per_outage(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jupyterlab_gpulab.push")
    p = pusher(f"{receiver.url}/api/push")
    receiver.status = 403
    for _ in range(5):
        assert not await p.push_once()
    assert p.failures == 5 and "HTTP 403 refused: not yours" in p.error
    receiver.status = 202
    assert await p.push_once()
    receiver.status = 500
    assert not await p.push_once()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "failed" in m]) == 2  # two outages, one line each
    assert len([m for m in messages if "works again" in m]) == 1
    p.stop()


async def test_an_unreachable_service_is_a_failure_not_an_exception() -> None:
    p = pusher(f"http://127.0.0.1:{free_port()}/api/push")
    assert not await p.push_once()
    assert p.error
    p.stop()


async def test_a_service_that_never_answers_times_out_without_blocking_the_loop(
    receiver: Receiver,
) -> None:
    receiver.hang = True
    p = pusher(f"{receiver.url}/api/push", timeout_seconds=0.5)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.get_running_loop().create_task(tick())
    assert not await p.push_once()
    ticker.cancel()
    assert "Timeout" in p.error
    assert ticks > 5  # the loop kept running while the push waited
    p.stop()


async def test_the_token_is_not_sent_on_to_where_a_redirect_points(receiver: Receiver) -> None:
    p = pusher(f"{receiver.url}/moved")
    assert not await p.push_once()
    assert "HTTP 307" in p.error
    assert receiver.seen == []  # the redirect's target never got the token
    p.stop()


async def test_the_pusher_pushes_every_interval_once_started(receiver: Receiver) -> None:
    p = MetricsPusher(f"{receiver.url}/api/push", "t", "ada", "", lambda: b"", 0.05)
    p.start(asyncio.get_running_loop())
    for _ in range(200):  # bounded
        if len(receiver.seen) >= 3:
            break
        await asyncio.sleep(0.05)
    p.stop()
    assert len(receiver.seen) >= 3 and p.pushes >= 3


def test_push_settings_come_from_the_hubs_environment() -> None:
    env = {
        "GPULAB_METRICS_PUSH_URL": "http://127.0.0.1:9/api/push",
        "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "5",
    }
    assert push_settings_from_env(env) == ("http://127.0.0.1:9/api/push", 5.0)
    assert push_settings_from_env({}) == ("", 15.0)
    with pytest.raises(
        ValueError, match="GPULAB_METRICS_PUSH_INTERVAL_SECONDS='x' is not a number"
    ):
        push_settings_from_env({"GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "x"})
    with pytest.raises(ValueError, match="must be more than 0"):
        push_settings_from_env({"GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "0"})
