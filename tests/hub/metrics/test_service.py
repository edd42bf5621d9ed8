"""gpulab-metrics' push -> aggregate -> rules path against real HTTP in the test.

The service's own web app listens on a loopback port; servers' pushes are real POSTs of pages
made with prometheus_client, the way jupyterlab-gpulab makes them. The hub is a small tornado
app answering what JupyterHub's API answers the service: GET /hub/api/user (whose token is
this, with its scopes), GET /hub/api/users?state=active (paginated) and GET /hub/api/users/<name>.
The real hub, proxy and servers are in tests/hub/metrics/test_service_in_hub.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import TraitError

from gpulab.hub.alerts import parse_rules
from gpulab.hub.services.metrics.aggregate import Aggregate
from gpulab.hub.services.metrics.exposition import exposition
from gpulab.hub.services.metrics.listing import Target, targets_from_users
from gpulab.hub.services.metrics.push import parse_exposition
from gpulab.hub.services.metrics.service import MetricsService
from tests.harness.ports import free_port

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


@pytest.fixture
async def world(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[World]:
    hub = Hub()
    hub_app = web.Application(
        [
            (r"/hub/api/user", WhoAmIHandler),
            (r"/hub/api/users", UsersHandler),
            (r"/hub/api/users/([^/]+)", UserHandler),
            (r"/hub/api/gpulab/allocations", AllocationsHandler),
        ],
        hub=hub,
    )
    hub_port, service_port = free_port(), free_port()
    hub_server = HTTPServer(hub_app)
    hub_server.listen(hub_port, "127.0.0.1")
    monkeypatch.setenv("JUPYTERHUB_API_URL", f"http://127.0.0.1:{hub_port}/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", SERVICE_TOKEN)
    monkeypatch.setenv("JUPYTERHUB_SERVICE_URL", f"http://127.0.0.1:{service_port}")
    monkeypatch.delenv("GPULAB_METRICS_CONFIG", raising=False)
    # pushes in a test come faster than any server's period
    service = MetricsService(min_push_interval_seconds=0)
    service.initialize([])
    service_server = HTTPServer(service.make_app())
    service_server.listen(service_port, "127.0.0.1")
    try:
        yield World(hub, service, f"http://127.0.0.1:{service_port}/api/push")
    finally:
        service_server.stop()
        hub_server.stop()
        if service.client is not None:
            service.client.close()


def families(text: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for mf in text_string_to_metric_families(text.decode()):
        for s in mf.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


async def test_pushes_of_two_users_servers_are_served_with_the_hubs_labels(world: World) -> None:
    world.hub.running |= {("ada", ""), ("bob", "train")}
    await world.service.cycle()
    await world.push_page("ada", "", [GPU("GPU-a", 93.0, 70 * GIB, 80 * GIB)])
    # bob's page claims to be ada's: the labels are the hub's, not the page's
    token = world.hub.server_token("bob", "train")
    body = page([GPU("GPU-b0", 10.0), GPU("MIG-b1", None, temperature_c=None)], "ada", "")
    r = await world.push(token, "bob", "train", body)
    assert r.status_code == 202 and r.json()["user"] == "bob", r.text

    metrics = families(exposition(world.service.aggregate))
    util = {
        (lb["user"], lb["server"], lb["gpu"]): v
        for lb, v in metrics["gpulab_gpu_utilization_ratio"]
    }
    assert util == {("ada", "", "GPU-a"): 0.93, ("bob", "train", "GPU-b0"): 0.10}
    up = {(lb["user"], lb["server"]): v for lb, v in metrics["gpulab_scrape_up"]}
    assert up == {("ada", ""): 1.0, ("bob", "train"): 1.0}  # not the page's spoofed 0
    assert "process_cpu_seconds" not in metrics
    assert metrics["gpulab_metrics_servers"] == [({}, 2.0)]
    assert metrics["gpulab_metrics_pushes_total"] == [({}, 2.0)]

    body_json = world.service.aggregate.servers_payload()
    ada, bob = body_json["servers"]
    assert (ada["user"], ada["server"], ada["up"], ada["pushes"]) == ("ada", "", True, 1)
    [gpu] = ada["gpus"]
    assert gpu["gpu"] == "GPU-a" and gpu["utilization_pct"] == pytest.approx(93.0)
    assert gpu["memory_used_mib"] == 70 * 1024 and gpu["memory_limit_mib"] == 80 * 1024
    assert [g["gpu"] for g in bob["gpus"]] == ["GPU-b0", "MIG-b1"]
    assert bob["gpus"][1]["utilization_pct"] is None and bob["gpus"][1]["temperature_c"] is None
    json.dumps(body_json)


async def test_bobs_token_claiming_adas_server_is_refused_and_changes_nothing(world: World) -> None:
    world.hub.running |= {("ada", ""), ("bob", "")}
    await world.service.cycle()
    await world.push_page("ada", "", [GPU("GPU-a", 10.0)])
    before = world.service.aggregate.servers_payload()

    bob = world.hub.server_token("bob", "")
    r = await world.push(bob, "ada", "", page([GPU("GPU-a", 99.0)], "ada", ""))
    assert r.status_code == 403, r.text
    assert r.json()["message"] == "a token of 'bob' cannot report for a server of 'ada'"

    after = world.service.aggregate.servers_payload()
    assert after["servers"] == before["servers"]
    assert after["push_refusals_total"] == 1
    util = families(exposition(world.service.aggregate))["gpulab_gpu_utilization_ratio"]
    assert util == [({"gpu": "GPU-a", "user": "ada", "server": ""}, 0.10)]


async def test_a_servers_token_reports_for_that_server_only(world: World) -> None:
    world.hub.running |= {("bob", ""), ("bob", "train")}
    await world.service.cycle()
    train = world.hub.server_token("bob", "train")
    r = await world.push(train, "bob", "", page([GPU("GPU-b")], "bob", ""))
    assert r.status_code == 403, r.text
    assert "lacks access:servers!server=bob/" in r.json()["message"]
    assert world.service.aggregate.servers["bob/"].pushes == 0


async def test_a_push_for_a_server_that_does_not_run_is_refused(world: World) -> None:
    await world.service.cycle()
    token = world.hub.server_token("ada", "gone")
    r = await world.push(token, "ada", "gone", page([GPU("GPU-a")], "ada", "gone"))
    assert r.status_code == 403, r.text
    assert r.json()["message"] == "'ada' has no running server 'gone'"
    assert world.service.aggregate.servers == {}


async def test_a_server_started_since_the_last_listing_is_checked_with_the_hub(
    world: World,
) -> None:
    await world.service.cycle()
    world.hub.running.add(("ada", "new"))  # after the listing
    await world.push_page("ada", "new", [GPU("GPU-n")])
    [server] = world.service.aggregate.servers_payload()["servers"]
    assert (server["user"], server["server"], server["up"]) == ("ada", "new", True)
    assert "/hub/api/users/ada" in world.hub.requests


async def test_pushes_without_a_valid_user_token_are_refused(world: World) -> None:
    world.hub.running.add(("ada", ""))
    await world.service.cycle()
    body = page([GPU("GPU-a")], "ada", "")
    r = await world.push(None, "ada", "", body)
    assert r.status_code == 401 and "Authorization: token" in r.json()["message"]
    r = await world.push("not-a-token", "ada", "", body)
    assert r.status_code == 403 and "not a valid hub token" in r.json()["message"]
    world.hub.tokens["svc"] = {"kind": "service", "name": "other", "scopes": ["access:servers"]}
    r = await world.push("svc", "ada", "", body)
    assert r.status_code == 403 and "only servers push" in r.json()["message"]
    assert world.service.aggregate.servers["ada/"].pushes == 0
    assert world.service.aggregate.push_refusals_total == 3


async def test_bad_push_bodies_are_refused_with_the_reason(world: World) -> None:
    world.hub.running.add(("ada", ""))
    await world.service.cycle()
    token = world.hub.server_token("ada", "")
    r = await world.push(token, "ada", "", b"this is { not prometheus\n")
    assert r.status_code == 400 and "not a Prometheus text exposition" in r.json()["message"]
    r = await world.push(token, "ada", "", b"\xff\xfe")
    assert r.status_code == 400
    world.service.max_push_bytes = 1000
    r = await world.push(token, "ada", "", b"# " + b"x" * 2000 + b"\n")
    assert r.status_code == 413 and "MetricsService.max_push_bytes" in r.json()["message"]
    state = world.service.aggregate.servers["ada/"]
    assert state.pushes == 0 and not state.up


async def test_pushes_closer_than_the_minimum_interval_are_refused(world: World) -> None:
    world.hub.running.add(("ada", ""))
    await world.service.cycle()
    world.service.min_push_interval_seconds = 3600
    await world.push_page("ada", "", [GPU("GPU-a", 10.0)])
    r = await world.push(world.hub.server_token("ada", ""), "ada", "", page([GPU("GPU-a")], "", ""))
    assert r.status_code == 429 and "min_push_interval_seconds" in r.json()["message"]
    assert world.service.aggregate.servers["ada/"].pushes == 1


async def test_a_workloads_report_token_reports_for_that_workload_only_while_it_holds_a_share(
    world: World,
) -> None:
    world.hub.running.add(("ada", ""))
    world.hub.allocations |= {"ada/", "ada/job-7", "ada/dask-2-w0", "ada/dask-2-scheduler"}
    await world.service.cycle()
    # the scheduler holds no GPU and is no report target; the run and the worker are
    assert set(world.service.aggregate.servers) == {"ada/", "ada/job-7", "ada/dask-2-w0"}
    job = world.hub.report_token("ada", "job-7")
    r = await world.push(job, "ada", "job-7", page([GPU("GPU-a", 40.0)], "x", "y"))
    assert r.status_code == 202, r.text
    assert r.json() == {"user": "ada", "server": "job-7", "series": 4}
    util = families(exposition(world.service.aggregate))["gpulab_gpu_utilization_ratio"]
    assert util == [({"gpu": "GPU-a", "user": "ada", "server": "job-7"}, 0.40)]

    # the run's token reaches nothing else: not her server, not her worker
    body = page([GPU("GPU-a")], "ada", "")
    r = await world.push(job, "ada", "", body)
    assert r.status_code == 403 and "lacks access:servers!server=ada/" in r.json()["message"]
    r = await world.push(job, "ada", "dask-2-w0", body)
    assert r.status_code == 403 and "is not 'dask-2-w0''s report token" in r.json()["message"]
    # her server's token is no report token; bob's report token is for his own workloads only
    r = await world.push(world.hub.server_token("ada", ""), "ada", "job-7", body)
    assert r.status_code == 403 and "lacks custom:gpulab:report-gpu!server=ada/job-7" in r.text
    r = await world.push(world.hub.report_token("bob", "job-7"), "ada", "job-7", body)
    assert r.status_code == 403
    assert (
        r.json()["message"]
        == "a token of 'bob' cannot report for a job run or Dask worker of 'ada'"
    )

    # the run ends (its share given back): forgotten at the next listing, then refused
    world.hub.allocations.discard("ada/job-7")
    await world.service.cycle()
    assert "ada/job-7" not in world.service.aggregate.servers
    r = await world.push(job, "ada", "job-7", body)
    assert r.status_code == 403
    assert r.json()["message"] == "'ada' has no job run or Dask worker 'job-7' on a GPU"


async def test_a_run_admitted_since_the_last_listing_is_checked_with_the_hub(world: World) -> None:
    await world.service.cycle()
    world.hub.allocations.add("ada/job-8")
    token = world.hub.report_token("ada", "job-8")
    r = await world.push(token, "ada", "job-8", page([GPU("GPU-a")], "", ""))
    assert r.status_code == 202, r.text
    assert "/hub/api/gpulab/allocations" in world.hub.requests


async def test_the_job_wrappers_reporter_pushes_a_runs_share_and_its_last_figures(
    world: World, tmp_path: Any
) -> None:
    """jupyterlab_gpulab's WorkloadReporter (what the job wrapper runs) against the service:
    its share's figures arrive as the run's, and closing it pushes once more."""
    from jupyterlab_gpulab.reporter import Report, WorkloadReporter
    from jupyterlab_gpulab.share import share_from_env

    world.service.min_push_interval_seconds = 0.5
    world.hub.allocations.add("ada/job-9")
    await world.service.cycle()
    figures = tmp_path / "gpus.json"
    figures.write_text(json.dumps({"*": {"utilization_pct": 70}}))
    env = {"GPULAB_GPU_UUIDS": "GPU-sim-0", "GPULAB_GPU_FRACTION": "0.25"}
    report = Report(
        world.push_url,
        world.hub.report_token("ada", "job-9"),
        "ada",
        "job-9",
        interval_seconds=30,
        source="simulated",
        simulated_file=str(figures),
    )
    reporter = WorkloadReporter(report, share=share_from_env(env), env=env)
    reporter.start(asyncio.get_running_loop())
    state = world.service.aggregate.servers["ada/job-9"]
    for _ in range(100):
        if state.pushes:
            break
        await asyncio.sleep(0.1)
    assert state.pushes == 1
    await reporter.close()  # waits out the service's minimum interval, then pushes the last
    assert state.pushes == 2 and reporter.pusher.failures == 0
    util = families(exposition(world.service.aggregate))["gpulab_gpu_utilization_ratio"]
    assert util == [({"gpu": "GPU-sim-0", "user": "ada", "server": "job-9"}, 0.70)]


def test_a_report_names_its_workload_and_refuses_what_is_wrong() -> None:
    from jupyterlab_gpulab.reporter import Report

    values = {
        "GPULAB_REPORT_URL": "http://127.0.0.1:1/api/push",
        "GPULAB_REPORT_TOKEN": "t",
        "GPULAB_REPORT_USER": "ada",
        "GPULAB_REPORT_NAME": "dask-3-w2",
        "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "5",
    }
    report = Report.from_mapping(values)
    assert report is not None and (report.user, report.name, report.interval_seconds) == (
        "ada",
        "dask-3-w2",
        5.0,
    )
    assert Report.from_mapping({}) is None  # no report: a hub without gpulab-metrics
    for key, bad, says in (
        ("GPULAB_REPORT_NAME", "", "no job run's or Dask worker's name"),
        ("GPULAB_REPORT_NAME", "train", "no job run's or Dask worker's name"),
        ("GPULAB_REPORT_USER", "", "GPULAB_REPORT_USER is empty"),
        ("GPULAB_METRICS_PUSH_INTERVAL_SECONDS", "soon", "is not a number"),
        ("GPULAB_METRICS_PUSH_INTERVAL_SECONDS", "0", "must be more than 0"),
    ):
        with pytest.raises(ValueError, match=says):
            Report.from_mapping({**values, key: bad})


async def test_idle_rule_fires_on_the_idle_server_only_and_lists_it_for_culling(
    world: World,
) -> None:
    world.service.aggregate = agg = Aggregate(
        parse_rules(
            'IF gpu_utilization < 5% FOR 1s THEN alert("IDLE_GPU", message="GPU idle")\n'
            'IF gpu_memory_used > 95% THEN alert("MEMORY_FULL", severity="critical")'
        )
    )
    world.hub.running |= {("ada", ""), ("bob", "")}
    await world.service.cycle()
    ada = [GPU("GPU-a0", 1.0), GPU("GPU-a1", 0.0)]
    bob = [GPU("GPU-b0", 1.0), GPU("GPU-b1", 80.0)]  # half busy
    await world.push_page("ada", "", ada)
    await world.push_page("bob", "", bob)
    assert agg.alerts_payload()["alerts"] == []  # FOR 1s: not on the first sample
    for _ in range(100):  # real pushes a little later; bounded
        await asyncio.sleep(0.1)
        await world.push_page("ada", "", ada)
        await world.push_page("bob", "", bob)
        if len(agg.alerts_payload()["alerts"]) >= 3:  # each server has its own clock
            break
    body = agg.alerts_payload()
    firing = sorted((a["user"], a["gpu"], a["rule"], a["state"]) for a in body["alerts"])
    assert firing == [
        ("ada", "GPU-a0", "IDLE_GPU", "firing"),
        ("ada", "GPU-a1", "IDLE_GPU", "firing"),
        ("bob", "GPU-b0", "IDLE_GPU", "firing"),
    ]
    assert {a["message"] for a in body["alerts"]} == {"GPU idle"}
    [idle] = body["idle_gpu_servers"]
    assert (idle["user"], idle["server"], idle["gpus"]) == ("ada", "", ["GPU-a0", "GPU-a1"])
    assert len(families(exposition(agg))["gpulab_hub_alert_active"]) == 3

    # ada fills her memory: a second rule fires with its own severity
    ada[0].used_bytes = 79 * GIB
    await world.push_page("ada", "", ada)
    full = [a for a in agg.active() if a["rule"] == "MEMORY_FULL"]
    assert [(a["gpu"], a["severity"]) for a in full] == [("GPU-a0", "critical")]

    # ada gets busy: her alerts resolve, she is no longer idle
    for g in ada:
        g.utilization_pct = 60.0
    await world.push_page("ada", "", ada)
    body = agg.alerts_payload()
    assert body["idle_gpu_servers"] == []
    resolved = [e for e in body["recent"] if e["state"] == "resolved" and e["user"] == "ada"]
    assert sorted(e["gpu"] for e in resolved if e["rule"] == "IDLE_GPU") == ["GPU-a0", "GPU-a1"]


async def test_a_stopped_server_is_dropped_and_its_alerts_resolve(world: World) -> None:
    world.service.aggregate = agg = Aggregate(
        parse_rules('IF gpu_utilization > 90% THEN alert("BUSY")')
    )
    world.hub.running.add(("ada", ""))
    await world.service.cycle()
    await world.push_page("ada", "", [GPU("GPU-a", 99.0)])
    assert [a["user"] for a in agg.active()] == ["ada"]
    world.hub.running.clear()
    await world.service.cycle()
    assert agg.active() == []
    assert agg.servers_payload()["servers"] == []
    assert [(e["rule"], e["state"]) for e in agg.recent] == [
        ("BUSY", "firing"),
        ("BUSY", "resolved"),
    ]
    assert "gpulab_gpu_utilization_ratio" not in families(exposition(agg))


async def test_a_server_that_stops_pushing_is_down_until_it_pushes_again(world: World) -> None:
    world.service.stale_after_seconds = 0.5
    world.hub.running |= {("ada", ""), ("bob", "")}
    await world.service.cycle()
    await world.push_page("ada", "", [GPU("GPU-a")])
    await asyncio.sleep(0.6)
    await world.push_page("bob", "", [GPU("GPU-b")])
    await world.service.cycle()
    body = {s["user"]: s for s in world.service.aggregate.servers_payload()["servers"]}
    assert not body["ada"]["up"] and body["ada"]["error"].startswith("no push for")
    assert body["bob"]["up"] and body["bob"]["error"] == ""
    metrics = families(exposition(world.service.aggregate))
    assert {lb["user"]: v for lb, v in metrics["gpulab_scrape_up"]} == {"ada": 0.0, "bob": 1.0}
    assert {lb["user"] for lb, _ in metrics["gpulab_gpu_utilization_ratio"]} == {"bob"}

    await world.push_page("ada", "", [GPU("GPU-a")])
    assert world.service.aggregate.servers["ada/"].up


async def test_a_server_that_never_pushes_is_down_with_a_hint(world: World) -> None:
    world.service.stale_after_seconds = 0.1
    world.hub.running.add(("ada", ""))
    await world.service.cycle()
    await asyncio.sleep(0.2)
    await world.service.cycle()
    [ada] = world.service.aggregate.servers_payload()["servers"]
    assert not ada["up"] and "is jupyterlab-gpulab installed" in ada["error"]


async def test_while_the_hub_is_down_the_known_servers_are_kept(world: World) -> None:
    world.hub.running.add(("ada", ""))
    await world.service.cycle()
    world.hub.down = True
    await world.service.cycle()
    body = world.service.aggregate.servers_payload()
    assert body["hub_error"].startswith("listing servers failed")
    assert [s["user"] for s in body["servers"]] == [
        "ada"
    ]  # a hub that does not answer stopped nothing
    r = await world.push(world.hub.server_token("bob", ""), "bob", "", page([], "bob", ""))
    assert r.status_code == 503 and "the hub did not" in r.json()["message"]


async def test_a_server_pushing_too_many_series_is_capped(world: World) -> None:
    world.service.max_series_per_server = 100
    world.hub.running.add(("ada", ""))
    await world.service.cycle()
    await world.push_page("ada", "", [GPU("GPU-a")], extra_series=5000)
    state = world.service.aggregate.servers["ada/"]
    assert state.up and state.result is not None
    assert sum(len(f.series) for f in state.result.families) == 100
    assert state.result.dropped_series > 4000


async def test_the_service_asks_the_hub_only_and_never_a_server(world: World) -> None:
    world.hub.running |= {("ada", ""), ("bob", "")}
    await world.service.cycle()
    await world.push_page("ada", "", [GPU("GPU-a")])
    await world.push_page("bob", "", [GPU("GPU-b")])
    await world.service.cycle()
    paths = {uri.split("?")[0] for uri in world.hub.requests}
    assert paths == {"/hub/api/users", "/hub/api/user", "/hub/api/gpulab/allocations"}


def test_parse_exposition_forces_labels_and_converts_units():
    text = (
        "# TYPE gpulab_gpu_memory_used_bytes gauge\n"
        'gpulab_gpu_memory_used_bytes{gpu="G",user="mallory",server="x"} 1073741824\n'
        'gpulab_gpu_memory_used_bytes{gpu="G",user="mallory",server="x"} 5\n'
        "# TYPE gpulab_gpu_power_watts gauge\n"
        'gpulab_gpu_power_watts{gpu="G"} 250\n'
        'gpulab_gpu_power_watts{gpu="H"} NaN\n'
    )
    fams, gpus, dropped = parse_exposition(text, Target("ada", "dev"))
    assert dropped == 0
    [used, power] = fams
    assert [dict(s.labels) for s in used.series] == [{"gpu": "G", "user": "ada", "server": "dev"}]
    assert gpus["G"].memory_used_mib == 1024 and gpus["G"].power_w == 250
    assert "H" not in gpus  # NaN is no figure


def test_targets_are_every_active_server_ready_or_starting():
    users = [
        {"name": "ada", "servers": {"": {"ready": True}}},
        {"name": "bob", "servers": {"gpu": {"ready": True}, "new": {"ready": False}}},
        {"name": "dee"},
    ]
    assert targets_from_users(users) == [
        Target("ada", ""),
        Target("bob", "gpu"),
        Target("bob", "new"),  # its extension may push before the hub saw it answer
    ]


def test_bad_options_are_refused_at_load_time_with_the_option():
    with pytest.raises(TraitError, match=r"MetricsService.rules: line 1, column 4: unknown metric"):
        MetricsService(rules='IF gpu_idle < 5% THEN alert("X")')
    with pytest.raises(TraitError, match="listing_interval_seconds must be more than 0"):
        MetricsService(listing_interval_seconds=0)
    with pytest.raises(TraitError, match="max_push_bytes must be at least 1"):
        MetricsService(max_push_bytes=0)


def test_staleness_follows_the_push_interval_the_hub_sets(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPULAB_METRICS_PUSH_INTERVAL_SECONDS", "2")
    service = MetricsService()
    assert (service.push_interval_seconds, service.stale_after_seconds) == (2.0, 6.0)


def test_a_bad_config_file_keeps_the_service_running_on_defaults_and_says_why(
    tmp_path, monkeypatch
):
    config = tmp_path / "metrics_config.py"
    config.write_text("c.MetricsService.rules = 'IF gpu_utilization < 5 THEN alert(\"IDLE\")'\n")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", SERVICE_TOKEN)
    service = MetricsService(config_file=str(config))
    service.initialize([])
    body = service.aggregate.alerts_payload()
    assert "MetricsService.rules: line 1, column 22: missing unit after 5" in body["config_error"]
    assert body["rules"] == [
        'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU", severity="warning")'
    ]
