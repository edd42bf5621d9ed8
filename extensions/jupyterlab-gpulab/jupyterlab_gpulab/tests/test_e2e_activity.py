"""An open GPU panel is not activity: through the real hub and proxy, a panel's websocket that
receives figures for longer than the idle timeout leaves the server's last_activity where it was,
and JupyterHub's idle culler stops the server anyway.

configurable-http-proxy counts every frame a client sends through a route as activity of that
server, pongs included, and the hub copies the route's last activity into the server's. The
monitor socket therefore sends no keep-alive pings (jupyter_server's sockets ping every 30 s;
here every second, well within the test's cull timeout, so that the test fails if the monitor
socket pings), and the panel sends nothing. A client that does send frames, beside it, shows that
the test would see such activity."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect
from traitlets.config import Config

from tests.harness.hub import passable_dir
from tests.harness.labserver import EXTENSION_SRC
from tests.harness.wait import wait_for

CULL_SECONDS = 12
PING_MS = 1000  # jupyter_server's ws_ping_interval (milliseconds)


def _last_activity(model: dict[str, Any] | None) -> datetime | None:
    stamp = (model or {}).get("last_activity")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


async def _panel(hub: Any, user: str) -> WebSocketClientConnection:
    url = hub.url.replace("http://", "ws://") + f"/user/{user}/gpulab/monitor/ws?rate_hz=4"
    ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {hub.token}"}))
    hello = json.loads(await ws.read_message())
    assert hello["type"] == "hello" and hello["devices"]
    assert hello["rate_hz"] == 4  # the server read the test's config (1 Hz by default)
    return ws


async def test_an_open_gpu_panel_does_not_keep_a_server_from_the_culler(
    make_hub, tmp_path: Path, monkeypatch
):
    # the servers run as their users' own accounts: their config lies where those may read it
    # (pytest's tmp_path is in a directory of root's alone)
    config = passable_dir(tmp_path / "jupyter-config")
    config.chmod(0o755)
    (config / "jupyter_server_config.d").mkdir(mode=0o755)
    (config / "jupyter_server_config.d" / "jupyterlab_gpulab.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"jupyterlab_gpulab": True}}})
    )
    # the servers' websockets ping every second (30 s by default, against a culler timeout of an
    # hour): each pong a client sends would reach the proxy well within the test's cull timeout
    (config / "jupyter_server_config.json").write_text(
        json.dumps(
            {
                "GPUMonitor": {"period_seconds": 0.25},
                "ServerApp": {"tornado_settings": {"ws_ping_interval": PING_MS}},
            }
        )
    )
    overlay = Config(GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"})
    overlay.Spawner.environment.update(
        {"PYTHONPATH": str(EXTENSION_SRC), "JUPYTER_CONFIG_PATH": str(config)}
    )
    hub = make_hub(overlay, env={"GPULAB_CULL_IDLE_SECONDS": str(CULL_SECONDS)})
    for user in ("ida", "jo"):
        hub.create_user(user)
        hub.start_server(user, profile="gpu-eighth")
    pings: list[bytes] = []  # the client answers pings with pongs, as browsers do
    monkeypatch.setattr(WebSocketClientConnection, "on_ping", lambda self, d: pings.append(d))
    silent, chatty = await _panel(hub, "ida"), await _panel(hub, "jo")
    frames, started, gone = 0, time.monotonic(), False
    try:
        await asyncio.sleep(3)  # whatever the handshakes counted has reached the hub by now
        settled = {u: _last_activity(hub.server_model(u)) for u in ("ida", "jo")}
        while time.monotonic() - started < 4 * CULL_SECONDS:
            model = hub.server_model("ida")
            if model is None:  # culled
                gone = True
                break
            assert _last_activity(model) == settled["ida"], "the open panel was activity"
            message = await asyncio.wait_for(silent.read_message(), 5)
            if message is None:  # the server went away with the panel open
                gone = True
                break
            frames += 1
            await chatty.write_message("typing")  # what a user at work sends
            await asyncio.sleep(0.2)
    finally:
        silent.close()
        chatty.close()
    gone = gone or hub.server_model("ida") is None
    assert gone, f"ida's server was still up after {4 * CULL_SECONDS} s with only a panel open"
    assert frames >= 5 and not pings  # figures all along, and never a ping to answer
    wait_for(
        "the culler to finish stopping ida's server", lambda: hub.server_model("ida") is None, 30
    )
    # the other client's frames did count
    assert _last_activity(hub.server_model("jo")) > settled["jo"]
