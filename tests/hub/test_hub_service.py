"""`hub_service.stop_server`, the stop the culler and the budget enforcer share: a server whose
start is still pending is left alone (JupyterHub's pending spawn fails with a 500 when its server
is stopped under it, and its caller's `before_stop` does not run), a ready one goes off the proxy
first and then stops."""

from __future__ import annotations

import asyncio
from typing import Any

from hub.hub_service import stop_server


class _Spawner:
    def __init__(self, pending: str | None) -> None:
        self.pending = pending
        self._stop_pending = False


class _User:
    def __init__(self, spawner: _Spawner, calls: list[str]) -> None:
        self.name = "carol"
        self.spawners = {"": spawner}
        self.calls = calls

    async def stop(self, name: str) -> None:
        self.calls.append(f"stop {name!r}")


class _Proxy:
    def __init__(self, calls: list[str], spawner: _Spawner) -> None:
        self.calls = calls
        self.spawner = spawner

    async def delete_user(self, user: Any, name: str) -> None:
        # JupyterHub's own stop marks the stop pending before the proxy call: so must ours
        assert self.spawner._stop_pending
        self.calls.append(f"proxy delete {name!r}")


class _App:
    def __init__(self, proxy: _Proxy) -> None:
        self.proxy = proxy


def _stop(pending: str | None) -> tuple[bool, list[str], _Spawner]:
    calls: list[str] = []
    spawner = _Spawner(pending)
    user = _User(spawner, calls)
    app = _App(_Proxy(calls, spawner))
    stopped = asyncio.run(stop_server(app, user, "", before_stop=lambda: calls.append("noted")))
    return stopped, calls, spawner


def test_a_ready_server_goes_off_the_proxy_then_stops() -> None:
    stopped, calls, spawner = _stop(None)
    assert stopped
    # the caller's note (why the share ends) comes first, once the stop is certain
    assert calls == ["noted", "proxy delete ''", "stop ''"]
    assert not spawner._stop_pending


def test_a_server_still_starting_or_stopping_is_left_alone() -> None:
    for pending in ("spawn", "proxy", "stop"):
        stopped, calls, _ = _stop(pending)
        assert not stopped and calls == [], pending
