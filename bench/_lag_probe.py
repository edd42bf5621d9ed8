"""Bench only: a jupyter server extension that measures its own server's event-loop lag.

bench.monitor loads it into every server it compares (the floor, jupyterlab-nvdashboard,
gpulab), so each is measured by the same meter: a 10 ms timer's lateness. GET /bench/lag returns
every lag since the last `?reset=1`, in milliseconds. Never ship this.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from jupyterlab_gpulab.lag import LoopLagMeter


class LagProbeHandler(APIHandler):
    @web.authenticated
    def get(self) -> None:
        meter: LoopLagMeter = self.settings["bench_lag_probe"]
        lags_ms = [lag * 1000 for lag in list(meter.lags)]  # the meter ticks on this loop too
        if self.get_argument("reset", "") == "1":
            meter.reset()
        self.finish(json.dumps({"lags_ms": lags_ms}))


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "bench._lag_probe"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    web_app = server_app.web_app
    web_app.settings["bench_lag_probe"] = LoopLagMeter()
    path = url_path_join(web_app.settings["base_url"], "bench/lag")
    web_app.add_handlers(".*$", [(path, LagProbeHandler)])


async def _start_jupyter_server_extension(server_app: Any) -> None:
    server_app.web_app.settings["bench_lag_probe"].start(asyncio.get_running_loop())
