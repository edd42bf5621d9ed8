"""HTTP and websocket API under <base_url>gpulab/monitor/ (the frontend's fixed contract)."""

from __future__ import annotations

import json
import math
import time
from typing import Any, cast

from jupyter_server.auth.decorator import ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.utils import url_path_join
from prometheus_client import CONTENT_TYPE_LATEST
from tornado import web
from tornado.websocket import WebSocketClosedError, WebSocketHandler

from .monitor import GPUMonitor
from .rules import RuleRejected
from .sampler import samples_json

NAMESPACE = "gpulab/monitor"


def _float_arg(handler: web.RequestHandler, name: str, default: float | None) -> float | None:
    raw = handler.get_argument(name, None)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise web.HTTPError(400, f"{name}={raw!r} is not a number (e.g. {name}=1.0)") from None
    if not math.isfinite(value):
        raise web.HTTPError(400, f"{name}={raw!r} must be a finite number")
    return value


class MonitorHandler(APIHandler):
    # watching GPU figures (or a metrics scrape) is not using the server: idle culling still applies
    _track_activity = False

    @property
    def monitor(self) -> GPUMonitor:
        return cast(GPUMonitor, self.settings["gpulab_monitor"])

    def write_json(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(body))


class DevicesHandler(MonitorHandler):
    @web.authenticated
    def get(self) -> None:
        self.write_json(self.monitor.devices_payload())


class SamplesHandler(MonitorHandler):
    @web.authenticated
    def get(self) -> None:
        since = _float_arg(self, "since", 0.0) or 0.0
        # half an hour of 8 GPUs is megabytes of JSON: it was encoded sample by sample, off the loop
        self.finish(samples_json(self.monitor.sampler.history(since)))


class RulesHandler(MonitorHandler):
    @web.authenticated
    def get(self) -> None:
        rules = self.monitor.rules
        body: dict[str, Any] = {"rules": rules.to_json(), "prometheus": rules.prometheus()}
        if rules.error:
            body["error"] = rules.error
        self.write_json(body)

    @web.authenticated
    def post(self) -> None:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            body = None
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str) or not text.strip():
            self.write_json(
                {
                    "message": 'Send {"text": "<rule>"}, e.g. IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU")',
                    "line": None,
                    "column": None,
                },
                400,
            )
            return
        try:
            entry = self.monitor.rules.add(text)
        except RuleRejected as e:
            self.write_json(e.to_json(), 400)
            return
        self.write_json({"rule": entry.to_json()}, 201)


class RuleHandler(MonitorHandler):
    @web.authenticated
    def delete(self, rule_id: str) -> None:
        try:
            resolved = self.monitor.rules.delete(rule_id, time.time())
        except KeyError:
            raise web.HTTPError(
                404, f"No alert rule with id {rule_id!r}; GET {NAMESPACE}/rules lists them"
            ) from None
        except PermissionError:
            raise web.HTTPError(
                409,
                f"Rule {rule_id!r} is a default rule (GPUMonitor.default_rules); only an admin can remove it",
            ) from None
        for event in resolved:
            self.monitor.broadcast_alert(event)
        self.set_status(204)
        self.finish()


class AlertsHandler(MonitorHandler):
    @web.authenticated
    def get(self) -> None:
        rules = self.monitor.rules
        self.write_json({"active": rules.active(), "recent": list(rules.recent)})


class MetricsHandler(MonitorHandler):
    @web.authenticated
    def get(self) -> None:
        self.finish(self.monitor.metrics_text(), set_content_type=CONTENT_TYPE_LATEST)


class StatsHandler(MonitorHandler):
    """The sampler's own cost: samples, NVML calls, CPU seconds of its thread."""

    @web.authenticated
    def get(self) -> None:
        self.write_json(self.monitor.stats())


class LagHandler(MonitorHandler):
    @web.authenticated
    def get(self) -> None:
        lag = self.monitor.lag
        if lag is None:
            raise web.HTTPError(
                404, "Loop-lag measurement is off; set GPUMonitor.measure_loop_lag = True"
            )
        summary = lag.summary()
        if self.get_argument("reset", "") in ("1", "true"):
            lag.reset()
        self.write_json(summary)


class MonitorWebSocket(WebSocketMixin, WebSocketHandler, JupyterHandler):
    """Pushes: hello (clamped rate and devices), then samples at the clamped rate, and alerts."""

    subscriber = None

    @property
    def ping_interval(self) -> int:
        """No keep-alive pings on this socket: the browser's pong to each one crosses the
        proxy, and configurable-http-proxy counts every frame a client sends as activity of the
        server, so an open panel would keep an idle server from JupyterHub's culler forever. The
        samples this socket pushes every period keep the connection alive instead (a vanished
        client fails the next write)."""
        return 0

    def set_default_headers(self) -> None:
        """No JupyterHandler page headers on a websocket upgrade."""

    @property
    def monitor(self) -> GPUMonitor:
        return cast(GPUMonitor, self.settings["gpulab_monitor"])

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        monitor = self.monitor
        if len(monitor.fanout) >= monitor.max_clients:
            raise web.HTTPError(
                503, f"{monitor.max_clients} GPU panels are open already (GPUMonitor.max_clients)"
            )
        self.requested_hz = _float_arg(self, "rate_hz", None)
        await super().get(*args, **kwargs)

    def open(self, *args: Any, **kwargs: Any) -> None:
        super().open()  # WebSocketMixin's, which starts no pings here (see ping_interval)
        self.subscriber = self.monitor.subscribe(self._send, self.requested_hz)
        hello = {
            "type": "hello",
            "rate_hz": self.subscriber.rate_hz,
            **self.monitor.devices_payload(),
        }
        self._send(json.dumps(hello))

    def _send(self, message: str) -> None:
        if self.ws_connection is None or self.ws_connection.is_closing():
            self._unsubscribe()
            return
        try:
            self.write_message(message)
        except WebSocketClosedError:
            self._unsubscribe()

    def _unsubscribe(self) -> None:
        if self.subscriber is not None:
            self.monitor.fanout.discard(self.subscriber)
            self.subscriber = None

    def on_message(self, message: str | bytes) -> None:
        """Panels only listen; anything they send is ignored."""

    def on_close(self) -> None:
        self._unsubscribe()


def setup_handlers(web_app: Any, monitor: GPUMonitor) -> None:
    web_app.settings["gpulab_monitor"] = monitor
    base = url_path_join(web_app.settings["base_url"], NAMESPACE)
    routes: list[tuple[str, type]] = [
        ("devices", DevicesHandler),
        ("samples", SamplesHandler),
        ("rules", RulesHandler),
        (r"rules/([A-Za-z0-9_-]+)", RuleHandler),
        ("alerts", AlertsHandler),
        ("metrics", MetricsHandler),
        ("stats", StatsHandler),
        ("lag", LagHandler),
        ("ws", MonitorWebSocket),
    ]
    web_app.add_handlers(".*$", [(url_path_join(base, path), cls) for path, cls in routes])
