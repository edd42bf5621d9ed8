"""The comparison for bench.monitor: an nvdashboard-style GPU websocket, NVML on the event loop.

Every client gets its own timer at the rate it asks for, and each tick reads every device
(utilisation, memory, process list) on the server's event loop, as jupyterlab-nvdashboard's
handlers call pynvml. Same simulated devices and call costs as gpulab's monitor. Bench only:
never ship this.
"""

from __future__ import annotations

import json
from typing import Any

from jupyter_server.auth.decorator import ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.ioloop import PeriodicCallback
from tornado.websocket import WebSocketHandler

from jupyterlab_gpulab.lag import LoopLagMeter
from jupyterlab_gpulab.share import share_from_env
from jupyterlab_gpulab.sources import SimulatedSource

DEVICES = 8


class NaiveGPUWebSocket(WebSocketMixin, WebSocketHandler, JupyterHandler):
    timer: PeriodicCallback | None = None

    def set_default_headers(self) -> None:
        pass

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        await super().get(*args, **kwargs)

    def open(self, *args: Any, **kwargs: Any) -> None:
        super().open()
        rate = float(self.get_argument("rate_hz", "1") or 1)
        self.timer = PeriodicCallback(self._tick, 1000.0 / rate)
        self.timer.start()

    def _tick(self) -> None:
        source: SimulatedSource = self.settings["naive_source"]
        figures = source.sample()  # blocks the loop for the whole NVML round trip
        body = {"t": source.clock(), "devices": {u: d.to_json() for u, d in figures.items()}}
        self.write_message(json.dumps({"type": "sample", "sample": body}))

    def on_message(self, message: str | bytes) -> None:
        pass

    def on_close(self) -> None:
        if self.timer is not None:
            self.timer.stop()


class NaiveLagHandler(APIHandler):
    @web.authenticated
    def get(self) -> None:
        lag: LoopLagMeter = self.settings["naive_lag"]
        summary = lag.summary()
        if self.get_argument("reset", "") == "1":
            lag.reset()
        self.finish(json.dumps(summary))


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "bench._naive_monitor"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    web_app = server_app.web_app
    web_app.settings["naive_source"] = SimulatedSource(share_from_env(), device_count=DEVICES)
    web_app.settings["naive_lag"] = LoopLagMeter()
    base = url_path_join(web_app.settings["base_url"], "naive/monitor")
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "ws"), NaiveGPUWebSocket),
            (url_path_join(base, "lag"), NaiveLagHandler),
        ],
    )


async def _start_jupyter_server_extension(server_app: Any) -> None:
    import asyncio

    server_app.web_app.settings["naive_lag"].start(asyncio.get_running_loop())
