"""gpulab-metrics' alert rules and servers' health against real HTTP in the test (the `world` of
tests/hub/metrics/conftest.py): the idle rule firing for culling, servers that stop, stop
pushing or never push, a hub that is down, a capped server, and a service that calls nobody but
the hub."""

from __future__ import annotations

import asyncio

from gpulab.hub.alerts import parse_rules
from gpulab.hub.services.metrics.aggregate import Aggregate
from gpulab.hub.services.metrics.exposition import exposition
from tests.harness.metrics_service import GIB, GPU, World, families, page


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
