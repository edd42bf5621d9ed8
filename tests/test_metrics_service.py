"""gpulab-metrics' scrape -> aggregate -> rules loop against real HTTP servers in the test.

The monitors are a small tornado app that serves pages made with prometheus_client, the way
jupyterlab-gpulab does, and the hub's GET /hub/api/users and /hub/api/proxy (paginated,
token-checked) for the listing. The real hub and proxy are in tests/test_e2e_metrics_service.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import TraitError

from gpulab.hub.metrics_exposition import exposition
from gpulab.hub.metrics_scrape import Target, parse_exposition, targets_from_users
from gpulab.hub.metrics_service import MetricsService

TOKEN = "service-token-0123"
GIB = 1024**3


@dataclass
class GPU:
    uuid: str
    utilization_pct: float | None = 50.0
    used_bytes: float = 10 * GIB
    limit_bytes: float = 80 * GIB
    temperature_c: float | None = 60.0


@dataclass
class FakeServer:
    gpus: list[GPU]
    claims_user: str = ""  # labels the page itself claims (must be ignored)
    status: int = 200
    body: str | None = None  # a raw body instead of the generated page
    extra_series: int = 0
    hang: bool = False  # never answers
    rendezvous: bool = False  # answers only once every rendezvous server was asked


@dataclass
class World:
    """What the test's hub lists and what each server's monitor answers."""

    servers: dict[tuple[str, str], FakeServer] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    unrouted: set[tuple[str, str]] = field(default_factory=set)
    arrived: set[str] = field(default_factory=set)
    monitors_url: str = ""


def page(server: FakeServer, user: str, name: str) -> bytes:
    class Collector:
        def collect(self):
            labels = ["gpu", "user", "server"]
            util = GaugeMetricFamily("gpulab_gpu_utilization_ratio", "util", labels=labels)
            used = GaugeMetricFamily("gpulab_gpu_memory_used_bytes", "used", labels=labels)
            limit = GaugeMetricFamily("gpulab_gpu_memory_limit_bytes", "limit", labels=labels)
            temp = GaugeMetricFamily("gpulab_gpu_temperature_celsius", "temp", labels=labels)
            for g in server.gpus:
                who = [g.uuid, server.claims_user or user, name]
                if g.utilization_pct is not None:
                    util.add_metric(who, g.utilization_pct / 100)
                used.add_metric(who, g.used_bytes)
                limit.add_metric(who, g.limit_bytes)
                if g.temperature_c is not None:
                    temp.add_metric(who, g.temperature_c)
            yield from (util, used, limit, temp)
            yield GaugeMetricFamily("gpulab_scrape_up", "spoofed self-metric", value=0)
            yield GaugeMetricFamily("process_cpu_seconds", "not a gpulab metric", value=3)
            if server.extra_series:
                many = GaugeMetricFamily("gpulab_gpu_process_memory_bytes", "m", labels=["pid"])
                for pid in range(server.extra_series):
                    many.add_metric([str(pid)], 1.0)
                yield many

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry)


class UsersHandler(web.RequestHandler):
    def get(self) -> None:
        world: World = self.settings["world"]
        assert self.request.headers["Authorization"] == f"token {TOKEN}"
        assert self.get_argument("state") == "active"
        users: dict[str, dict[str, Any]] = {}
        for user, name in sorted(world.servers):
            prefix = f"/user/{user}/{name + '/' if name else ''}"
            users.setdefault(user, {"name": user, "servers": {}})["servers"][name] = {
                "name": name,
                "ready": True,
                "url": prefix,
            }
        users["idle-no-server"] = {"name": "idle-no-server", "servers": {}}
        users["starting"] = {"name": "starting", "servers": {"": {"ready": False, "url": "/x/"}}}
        items = list(users.values())
        offset, limit = int(self.get_argument("offset")), 2  # small pages: pagination is used
        chunk = items[offset : offset + limit]
        more = offset + limit < len(items)
        self.finish(
            json.dumps(
                {
                    "items": chunk,
                    "_pagination": {"next": {"offset": offset + limit} if more else None},
                }
            )
        )


class ProxyRoutesHandler(web.RequestHandler):
    """GET /hub/api/proxy: the routing table, each server's route targeting the monitors' app."""

    def get(self) -> None:
        world: World = self.settings["world"]
        assert self.request.headers["Authorization"] == f"token {TOKEN}"
        routes: dict[str, Any] = {"/": {"target": "http://127.0.0.1:1", "data": {"hub": True}}}
        for user, name in world.servers:
            if (user, name) in world.unrouted:
                continue
            spec = f"/user/{user}/{name + '/' if name else ''}"
            routes[spec] = {
                "routespec": spec,
                "target": world.monitors_url,
                "data": {"user": user, "server_name": name},
            }
        self.finish(json.dumps({"items": routes, "_pagination": {"next": None}}))


class MonitorHandler(web.RequestHandler):
    async def get(self, user: str, name: str | None) -> None:
        world: World = self.settings["world"]
        world.requests.append(f"{user}/{name or ''}")
        if self.request.headers.get("Authorization") != f"token {TOKEN}":
            raise web.HTTPError(403)
        server = world.servers[(user, name or "")]
        if server.hang:
            await asyncio.Event().wait()
        if server.rendezvous:
            world.arrived.add(user)
            everyone = {u for (u, _), srv in world.servers.items() if srv.rendezvous}
            while world.arrived != everyone:
                await asyncio.sleep(0.01)  # ends when the others are asked, or the scrape times out
        if server.status != 200:
            raise web.HTTPError(server.status)
        self.set_header("Content-Type", "text/plain; version=0.0.4")
        self.finish(server.body if server.body is not None else page(server, user, name or ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def world() -> AsyncIterator[tuple[World, str]]:
    w = World()
    app = web.Application(
        [
            (r"/hub/api/users", UsersHandler),
            (r"/hub/api/proxy", ProxyRoutesHandler),
            (r"/user/([^/]+)/(?:([^/]+)/)?gpulab/monitor/metrics", MonitorHandler),
        ],
        world=w,
    )
    port = free_port()
    server = HTTPServer(app)
    server.listen(port, "127.0.0.1")
    w.monitors_url = f"http://127.0.0.1:{port}"
    try:
        yield w, f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def make_service(url: str, monkeypatch: pytest.MonkeyPatch, **traits: Any) -> MetricsService:
    monkeypatch.setenv("JUPYTERHUB_API_URL", f"{url}/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", TOKEN)
    monkeypatch.delenv("GPULAB_METRICS_CONFIG", raising=False)
    service = MetricsService(scrape_timeout_seconds=5, **traits)
    service.initialize([])
    return service


def families(text: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for mf in text_string_to_metric_families(text.decode()):
        for s in mf.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


async def test_a_cycle_scrapes_every_ready_server_and_keeps_the_hubs_labels(world, monkeypatch):
    w, url = world
    w.servers[("ada", "")] = FakeServer([GPU("GPU-a", 93.0, 70 * GIB, 80 * GIB)])
    w.servers[("bob", "train")] = FakeServer(
        [GPU("GPU-b0", 10.0), GPU("MIG-b1", None, temperature_c=None)], claims_user="ada"
    )
    service = make_service(url, monkeypatch)
    await service.cycle()

    assert sorted(w.requests) == ["ada/", "bob/train"]
    metrics = families(exposition(service.aggregate))
    util = {
        (lb["user"], lb["server"], lb["gpu"]): v
        for lb, v in metrics["gpulab_gpu_utilization_ratio"]
    }
    assert util == {("ada", "", "GPU-a"): 0.93, ("bob", "train", "GPU-b0"): 0.10}
    up = {(lb["user"], lb["server"]): v for lb, v in metrics["gpulab_scrape_up"]}
    assert up == {("ada", ""): 1.0, ("bob", "train"): 1.0}  # not the page's spoofed 0
    assert "process_cpu_seconds" not in metrics
    assert metrics["gpulab_metrics_servers"] == [({}, 2.0)]
    assert metrics["gpulab_metrics_cycles_total"] == [({}, 1.0)]

    body = service.aggregate.servers_payload()
    ada, bob = body["servers"]
    assert (ada["user"], ada["server"], ada["up"]) == ("ada", "", True)
    [gpu] = ada["gpus"]
    assert gpu["gpu"] == "GPU-a" and gpu["utilization_pct"] == pytest.approx(93.0)
    assert gpu["memory_used_mib"] == 70 * 1024 and gpu["memory_limit_mib"] == 80 * 1024
    assert [g["gpu"] for g in bob["gpus"]] == ["GPU-b0", "MIG-b1"]
    assert bob["gpus"][1]["utilization_pct"] is None and bob["gpus"][1]["temperature_c"] is None
    json.dumps(body)


async def test_idle_rule_fires_on_the_idle_server_only_and_lists_it_for_culling(world, monkeypatch):
    w, url = world
    w.servers[("ada", "")] = FakeServer([GPU("GPU-a0", 1.0), GPU("GPU-a1", 0.0)])
    w.servers[("bob", "")] = FakeServer([GPU("GPU-b0", 1.0), GPU("GPU-b1", 80.0)])  # half busy
    service = make_service(
        url,
        monkeypatch,
        rules='IF gpu_utilization < 5% FOR 1s THEN alert("IDLE_GPU", message="GPU idle")\n'
        'IF gpu_memory_used > 95% THEN alert("MEMORY_FULL", severity="critical")',
    )
    await service.cycle()
    assert service.aggregate.alerts_payload()["alerts"] == []  # FOR 1s: not on the first sample
    for _ in range(100):  # real scrapes a little later; bounded
        await asyncio.sleep(0.1)
        await service.cycle()
        if len(service.aggregate.alerts_payload()["alerts"]) >= 3:  # each server has its own clock
            break
    body = service.aggregate.alerts_payload()
    firing = sorted((a["user"], a["gpu"], a["rule"], a["state"]) for a in body["alerts"])
    assert firing == [
        ("ada", "GPU-a0", "IDLE_GPU", "firing"),
        ("ada", "GPU-a1", "IDLE_GPU", "firing"),
        ("bob", "GPU-b0", "IDLE_GPU", "firing"),
    ]
    assert {a["message"] for a in body["alerts"]} == {"GPU idle"}
    [idle] = body["idle_gpu_servers"]
    assert (idle["user"], idle["server"], idle["gpus"]) == ("ada", "", ["GPU-a0", "GPU-a1"])
    metrics = families(exposition(service.aggregate))
    assert len(metrics["gpulab_hub_alert_active"]) == 3

    # ada fills her memory: a second rule fires with its own severity
    w.servers[("ada", "")].gpus[0].used_bytes = 79 * GIB
    await service.cycle()
    full = [a for a in service.aggregate.active() if a["rule"] == "MEMORY_FULL"]
    assert [(a["gpu"], a["severity"]) for a in full] == [("GPU-a0", "critical")]

    # ada gets busy: her alerts resolve, she is no longer idle
    for g in w.servers[("ada", "")].gpus:
        g.utilization_pct = 60.0
    await service.cycle()
    body = service.aggregate.alerts_payload()
    assert body["idle_gpu_servers"] == []
    resolved = [e for e in body["recent"] if e["state"] == "resolved" and e["user"] == "ada"]
    assert sorted(e["gpu"] for e in resolved if e["rule"] == "IDLE_GPU") == ["GPU-a0", "GPU-a1"]


async def test_a_stopped_server_is_dropped_and_its_alerts_resolve(world, monkeypatch):
    w, url = world
    w.servers[("ada", "")] = FakeServer([GPU("GPU-a", 99.0)])
    service = make_service(url, monkeypatch, rules='IF gpu_utilization > 90% THEN alert("BUSY")')
    await service.cycle()
    assert [a["user"] for a in service.aggregate.active()] == ["ada"]
    del w.servers[("ada", "")]
    await service.cycle()
    assert service.aggregate.active() == []
    assert service.aggregate.servers_payload()["servers"] == []
    assert [(e["rule"], e["state"]) for e in service.aggregate.recent] == [
        ("BUSY", "firing"),
        ("BUSY", "resolved"),
    ]
    assert "gpulab_gpu_utilization_ratio" not in families(exposition(service.aggregate))


async def test_failing_servers_are_down_with_a_reason_and_others_still_scraped(world, monkeypatch):
    w, url = world
    w.servers[("ada", "")] = FakeServer([GPU("GPU-a")])
    w.servers[("bob", "")] = FakeServer([], status=403)
    w.servers[("carol", "")] = FakeServer([], status=404)
    w.servers[("dan", "")] = FakeServer([], body="this is { not prometheus\n")
    service = make_service(url, monkeypatch)
    await service.cycle()
    body = {s["user"]: s for s in service.aggregate.servers_payload()["servers"]}
    assert body["ada"]["up"] and body["ada"]["error"] == ""
    assert not body["bob"]["up"] and "access:servers" in body["bob"]["error"]
    assert not body["carol"]["up"] and "jupyterlab-gpulab" in body["carol"]["error"]
    assert not body["dan"]["up"] and "not a Prometheus text exposition" in body["dan"]["error"]
    metrics = families(exposition(service.aggregate))
    up = {lb["user"]: v for lb, v in metrics["gpulab_scrape_up"]}
    assert up == {"ada": 1.0, "bob": 0.0, "carol": 0.0, "dan": 0.0}
    assert metrics["gpulab_metrics_scrape_failures_total"] == [({}, 3.0)]


async def test_an_unreachable_server_is_down_and_the_cycle_finishes(monkeypatch, world):
    _, url = world
    service = make_service(url, monkeypatch, scrape_interval_seconds=1)
    dead = Target("eve", "", f"http://127.0.0.1:{free_port()}/user/eve/gpulab/monitor/metrics")
    service.aggregate.set_targets([dead], 0.0)
    service.api_url = f"http://127.0.0.1:{free_port()}/hub/api"  # the hub is down too
    await service.cycle()
    body = service.aggregate.servers_payload()
    assert body["hub_error"].startswith("listing servers failed")
    [eve] = body["servers"]  # kept: a hub that does not answer has not stopped anything
    assert not eve["up"] and eve["error"]


async def test_a_server_exporting_too_many_series_is_capped(world, monkeypatch):
    w, url = world
    w.servers[("ada", "")] = FakeServer([GPU("GPU-a")], extra_series=5000)
    service = make_service(url, monkeypatch, max_series_per_server=100)
    await service.cycle()
    [state] = service.aggregate.servers.values()
    assert state.up and state.result is not None
    assert sum(len(f.series) for f in state.result.families) == 100
    assert state.result.dropped_series > 4000


def test_parse_exposition_forces_labels_and_converts_units():
    text = (
        "# TYPE gpulab_gpu_memory_used_bytes gauge\n"
        'gpulab_gpu_memory_used_bytes{gpu="G",user="mallory",server="x"} 1073741824\n'
        'gpulab_gpu_memory_used_bytes{gpu="G",user="mallory",server="x"} 5\n'
        "# TYPE gpulab_gpu_power_watts gauge\n"
        'gpulab_gpu_power_watts{gpu="G"} 250\n'
        'gpulab_gpu_power_watts{gpu="H"} NaN\n'
    )
    fams, gpus, dropped = parse_exposition(text, Target("ada", "dev", "u"))
    assert dropped == 0
    [used, power] = fams
    assert [dict(s.labels) for s in used.series] == [{"gpu": "G", "user": "ada", "server": "dev"}]
    assert gpus["G"].memory_used_mib == 1024 and gpus["G"].power_w == 250
    assert "H" not in gpus  # NaN is no figure


def test_targets_are_the_ready_servers_at_their_proxy_route_targets():
    users = [
        {"name": "ada", "servers": {"": {"ready": True, "url": "/user/ada/"}}},
        {"name": "bob", "servers": {"gpu": {"ready": True, "url": "/base/user/bob/gpu/"}}},
        {"name": "cy", "servers": {"": {"ready": False, "url": "/user/cy/"}}},
        {"name": "dee"},
        {"name": "eve", "servers": {"": {"ready": True, "url": "/user/eve/"}}},
    ]
    routes = {
        "/": {"target": "http://127.0.0.1:8081", "data": {"hub": True}},
        "/user/ada/": {
            "target": "http://10.0.0.5:8888",
            "data": {"user": "ada", "server_name": ""},
        },
        "/base/user/bob/gpu/": {
            "target": "http://127.0.0.1:50123/",
            "data": {"user": "bob", "server_name": "gpu"},
        },
        "/services/x/": {"target": "http://127.0.0.1:9", "data": {"service": "x"}},
    }
    assert targets_from_users(users, routes) == [
        Target("ada", "", "http://10.0.0.5:8888/user/ada/gpulab/monitor/metrics"),
        Target("bob", "gpu", "http://127.0.0.1:50123/base/user/bob/gpu/gpulab/monitor/metrics"),
        Target("eve", "", ""),  # ready, but not routed (yet): listed as down, not scraped
    ]


async def test_a_ready_server_without_a_route_is_down_with_the_reason(world, monkeypatch):
    w, url = world
    w.servers[("ada", "")] = FakeServer([GPU("GPU-a")])
    w.unrouted.add(("ada", ""))
    service = make_service(url, monkeypatch)
    await service.cycle()
    [ada] = service.aggregate.servers_payload()["servers"]
    assert not ada["up"] and "no route" in ada["error"]
    assert w.requests == []


def test_bad_rules_are_refused_at_load_time_with_the_option_and_position():
    with pytest.raises(TraitError, match=r"MetricsService.rules: line 1, column 4: unknown metric"):
        MetricsService(rules='IF gpu_idle < 5% THEN alert("X")')
    with pytest.raises(TraitError, match="scrape_interval_seconds must be more than 0"):
        MetricsService(scrape_interval_seconds=0)


async def test_servers_are_scraped_concurrently(world, monkeypatch):
    w, url = world
    # each answers only once all three were asked: scraping one after the other would time out
    for user in ("ada", "bob", "cy"):
        w.servers[(user, "")] = FakeServer([GPU(f"GPU-{user}")], rendezvous=True)
    service = make_service(url, monkeypatch)
    await service.cycle()
    assert [s["up"] for s in service.aggregate.servers_payload()["servers"]] == [True] * 3


async def test_a_server_that_never_answers_times_out_without_holding_up_the_others(
    world, monkeypatch
):
    w, url = world
    w.servers[("ada", "")] = FakeServer([GPU("GPU-a")])
    w.servers[("bob", "")] = FakeServer([GPU("GPU-b")], hang=True)
    service = make_service(url, monkeypatch)
    service.scrape_timeout_seconds = 1
    await service.cycle()
    body = {s["user"]: s for s in service.aggregate.servers_payload()["servers"]}
    assert body["ada"]["up"]
    assert not body["bob"]["up"] and "Timeout" in body["bob"]["error"]


def test_a_bad_config_file_keeps_the_service_running_on_defaults_and_says_why(
    tmp_path, monkeypatch
):
    config = tmp_path / "metrics_config.py"
    config.write_text("c.MetricsService.rules = 'IF gpu_utilization < 5 THEN alert(\"IDLE\")'\n")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", TOKEN)
    service = MetricsService(config_file=str(config))
    service.initialize([])
    body = service.aggregate.alerts_payload()
    assert "MetricsService.rules: line 1, column 22: missing unit after 5" in body["config_error"]
    assert body["rules"] == [
        'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU", severity="warning")'
    ]
