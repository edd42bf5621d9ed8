"""gpulab-metrics' push -> aggregate -> rules path against real HTTP in the test.

The service's own web app listens on a loopback port; servers' pushes are real POSTs of pages
made with prometheus_client, the way jupyterlab-gpulab makes them. The hub is a small tornado
app answering what JupyterHub's API answers the service: GET /hub/api/user (whose token is
this, with its scopes), GET /hub/api/users?state=active (paginated) and GET /hub/api/users/<name>.
These are the pushes: who may push for what, workloads' reports, the pages' parsing. Alerts and
servers' health are in test_service_health.py, the options in test_service_options.py, the real
hub, proxy and servers in tests/hub/metrics/test_service_in_hub.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gpulab.hub.services.metrics.exposition import exposition
from gpulab.hub.services.metrics.listing import Target, targets_from_users
from gpulab.hub.services.metrics.push import parse_exposition
from tests.harness.metrics_service import GIB, GPU, World, families, page


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
