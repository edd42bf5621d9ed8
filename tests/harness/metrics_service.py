"""A small hub for the gpulab-metrics service's tests, and the servers that push to it: the hub
API the service calls (whose token is this, the active users paginated, one user, the
allocations), tokens as JupyterHub and gpulab give them, pages as a server's GPU monitor exports
them (`page`), and the `World` the tests push through.

Apart from tests/hub/metrics/test_service*.py, which share it; their `world` fixture
(tests/hub/metrics/conftest.py) serves this hub and the service's own app on loopback ports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from tornado import web

from gpulab.hub.services.metrics.service import MetricsService

SERVICE_TOKEN = "service-token-0123"
GIB = 1024**3


@dataclass
class GPU:
    uuid: str
    utilization_pct: float | None = 50.0
    used_bytes: float = 10 * GIB
    limit_bytes: float = 80 * GIB
    temperature_c: float | None = 60.0


def page(gpus: list[GPU], user: str, name: str, extra_series: int = 0) -> bytes:
    """What a server's GPU monitor exports, labels included (which the service must ignore)."""

    class Collector:
        def collect(self):
            labels = ["gpu", "user", "server"]
            util = GaugeMetricFamily("gpulab_gpu_utilization_ratio", "util", labels=labels)
            used = GaugeMetricFamily("gpulab_gpu_memory_used_bytes", "used", labels=labels)
            limit = GaugeMetricFamily("gpulab_gpu_memory_limit_bytes", "limit", labels=labels)
            temp = GaugeMetricFamily("gpulab_gpu_temperature_celsius", "temp", labels=labels)
            for g in gpus:
                who = [g.uuid, user, name]
                if g.utilization_pct is not None:
                    util.add_metric(who, g.utilization_pct / 100)
                used.add_metric(who, g.used_bytes)
                limit.add_metric(who, g.limit_bytes)
                if g.temperature_c is not None:
                    temp.add_metric(who, g.temperature_c)
            yield from (util, used, limit, temp)
            yield GaugeMetricFamily("gpulab_scrape_up", "spoofed self-metric", value=0)
            yield GaugeMetricFamily("process_cpu_seconds", "not a gpulab metric", value=3)
            if extra_series:
                many = GaugeMetricFamily("gpulab_gpu_process_memory_bytes", "m", labels=["pid"])
                for pid in range(extra_series):
                    many.add_metric([str(pid)], 1.0)
                yield many

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry)


@dataclass
class Hub:
    """What the test's hub knows: running servers and tokens."""

    running: set[tuple[str, str]] = field(default_factory=set)
    #: allocation ids the allocator holds (GET /hub/api/gpulab/allocations)
    allocations: set[str] = field(default_factory=set)
    tokens: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    down: bool = False

    def server_token(self, user: str, server: str) -> str:
        """A token as JupyterHub gives a server ($JUPYTERHUB_API_TOKEN, the `server` role)."""
        token = f"server-{user}-{server or 'default'}"
        self.tokens[token] = {
            "kind": "user",
            "name": user,
            "admin": False,
            "scopes": [
                f"access:servers!server={user}/{server}",
                f"users:activity!user={user}",
                f"read:users:name!user={user}",
            ],
        }
        return token

    def report_token(self, user: str, workload: str) -> str:
        """A job run's or Dask worker's report token, as gpulab.hub.report_tokens issues it."""
        token = f"report-{user}-{workload}"
        self.tokens[token] = {
            "kind": "user",
            "name": user,
            "admin": False,
            "scopes": [f"custom:gpulab:report-gpu!server={user}/{workload}"],
        }
        return token


class HubHandler(web.RequestHandler):
    @property
    def hub(self) -> Hub:
        return self.settings["hub"]

    def prepare(self) -> None:
        self.hub.requests.append(self.request.uri or "")
        if self.hub.down:
            raise web.HTTPError(502)


class WhoAmIHandler(HubHandler):
    def get(self) -> None:
        token = self.request.headers.get("Authorization", "").removeprefix("token ")
        if token not in self.hub.tokens:
            raise web.HTTPError(403)
        self.finish(json.dumps(self.hub.tokens[token]))


class UsersHandler(HubHandler):
    def get(self) -> None:
        assert self.request.headers["Authorization"] == f"token {SERVICE_TOKEN}"
        assert self.get_argument("state") == "active"
        users: dict[str, dict[str, Any]] = {}
        for user, name in sorted(self.hub.running):
            users.setdefault(user, {"name": user, "servers": {}})["servers"][name] = {"name": name}
        items = list(users.values())
        offset, limit = int(self.get_argument("offset")), 2  # small pages: pagination is used
        more = offset + limit < len(items)
        self.finish(
            json.dumps(
                {
                    "items": items[offset : offset + limit],
                    "_pagination": {"next": {"offset": offset + limit} if more else None},
                }
            )
        )


class UserHandler(HubHandler):
    def get(self, user: str) -> None:
        assert self.request.headers["Authorization"] == f"token {SERVICE_TOKEN}"
        servers = {name: {"name": name} for (u, name) in self.hub.running if u == user}
        self.finish(json.dumps({"name": user, "servers": servers}))


class AllocationsHandler(HubHandler):
    def get(self) -> None:
        assert self.request.headers["Authorization"] == f"token {SERVICE_TOKEN}"
        allocations = [{"id": a, "owner": a.split("/")[0]} for a in sorted(self.hub.allocations)]
        self.finish(json.dumps({"inventory": "test", "allocations": allocations}))


@dataclass
class World:
    hub: Hub
    service: MetricsService
    push_url: str

    async def push(self, token: str | None, user: str, server: str, body: bytes) -> httpx.Response:
        headers = {"Authorization": f"token {token}"} if token else {}
        path = f"{user}/{server}" if server else user
        async with httpx.AsyncClient(timeout=30) as client:
            return await client.post(f"{self.push_url}/{path}", content=body, headers=headers)

    async def push_page(self, user: str, server: str, gpus: list[GPU], **kw: Any) -> None:
        token = self.hub.server_token(user, server)
        r = await self.push(token, user, server, page(gpus, user, server, **kw))
        assert r.status_code == 202, r.text


def families(text: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for mf in text_string_to_metric_families(text.decode()):
        for s in mf.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out
