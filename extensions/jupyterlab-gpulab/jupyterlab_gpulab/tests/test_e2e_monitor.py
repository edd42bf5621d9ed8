"""gpulab's monitor API on a real `jupyter server`, simulated GPUs driven by a figures file."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect
from traitlets.config import Config

from tests.harness.labserver import LabServer, pids_with_marker
from tests.harness.wait import wait_for

pytestmark = pytest.mark.slow

WHOLE = "GPU-0e2e0000-1111-2222-3333-444444444444"
MIG = "MIG-0e2e0000-5555-6666-7777-888888888888"


@pytest.fixture
def figures(tmp_path: Path) -> Path:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"*": {"utilization_pct": 50}}))
    return path


@pytest.fixture
def lab(make_lab_server, figures: Path) -> LabServer:
    return make_lab_server(
        "lab",
        env={
            "GPULAB_MONITOR_SOURCE": "simulated",
            "GPULAB_GPU_UUIDS": f"{WHOLE},{MIG}",
            "GPULAB_PROFILE": "gpu-whole",
            "JUPYTERHUB_USER": "ada",
            "GPULAB_SIMULATED_GPU_FILE": str(figures),
        },
        config=Config({"GPUMonitor": {"period_seconds": 0.25}}),
    )


async def connect(lab: LabServer, query: str = "", **headers: str) -> WebSocketClientConnection:
    request = HTTPRequest(
        f"{lab.ws_url}/gpulab/monitor/ws{query}",
        headers={**lab.headers, **headers},
        connect_timeout=20,
        request_timeout=20,
    )
    return await websocket_connect(request)


async def next_message(
    ws: WebSocketClientConnection, kind: str, timeout: float = 20
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        raw = await asyncio.wait_for(ws.read_message(), max(0.1, deadline - time.monotonic()))
        assert raw is not None, "the server closed the websocket"
        msg = json.loads(raw)
        if msg["type"] == kind:
            return msg


def set_figures(path: Path, figures: dict[str, Any]) -> None:
    """Script the simulated GPUs (GPULAB_SIMULATED_GPU_FILE); the server re-reads it on change."""
    path.write_text(json.dumps(figures))


async def test_every_endpoint_refuses_requests_without_a_token(lab: LabServer) -> None:
    async with httpx.AsyncClient(base_url=f"{lab.url}/gpulab/monitor/", timeout=10) as anonymous:
        for path in ("devices", "samples", "rules", "alerts", "metrics", "stats"):
            r = await anonymous.get(path)
            assert r.status_code == 403, (path, r.status_code)
    with pytest.raises(HTTPClientError) as e:
        await websocket_connect(HTTPRequest(f"{lab.ws_url}/gpulab/monitor/ws", connect_timeout=20))
    assert e.value.code == 403
    # the token in the query, as JupyterLab's ServerConnection sends it when it appends tokens
    ws = await websocket_connect(
        HTTPRequest(
            f"{lab.ws_url}/gpulab/monitor/ws?rate_hz=1&token={lab.token}", connect_timeout=20
        )
    )
    try:
        assert (await next_message(ws, "hello"))["rate_hz"] == 1
    finally:
        ws.close()


def test_devices_describe_the_share_and_say_the_figures_are_simulated(lab: LabServer) -> None:
    body = lab.get("devices").json()
    assert body["source"] == "simulated" and body["simulated"] is True
    assert "simulated" in body["message"].lower()
    assert body["period_seconds"] == 0.25 and body["max_rate_hz"] == 4.0
    assert body["share"] == {
        "profile": "gpu-whole",
        "fraction": None,
        "memory_limit_mib": None,
        "enforcement": "exclusive",
        "model": "",
    }
    whole, mig = body["devices"]
    assert whole["uuid"] == WHOLE and whole["whole"] and not whole["mig"]
    assert whole["memory_limit_mib"] == whole["memory_total_mib"]
    assert mig["uuid"] == MIG and mig["mig"] and not mig["whole"]
    assert set(whole) == {
        "uuid",
        "name",
        "index",
        "mig",
        "whole",
        "memory_total_mib",
        "memory_limit_mib",
    }


def test_samples_backfill_history_since_a_time(lab: LabServer) -> None:
    samples = wait_for(
        "three samples",
        lambda: (
            len(lab.get("samples").json()["samples"]) >= 3 and lab.get("samples").json()["samples"]
        ),
        20,
        0.1,
    )
    device = samples[-1]["devices"][WHOLE]
    assert device["utilization_pct"] == 50
    assert device["temperature_c"] is not None and device["power_w"] is not None
    assert samples[-1]["devices"][MIG]["temperature_c"] is None
    assert {"pid", "memory_mib", "own", "name"} <= set(device["processes"][0])
    since = samples[-2]["t"]
    later = lab.get("samples", params={"since": since}).json()["samples"]
    assert later and all(s["t"] > since for s in later)
    assert lab.get("samples", params={"since": "yesterday"}).status_code == 400


async def test_a_websocket_asking_twenty_hertz_is_clamped_and_gets_samples(lab: LabServer) -> None:
    ws = await connect(lab, "?rate_hz=20")
    try:
        hello = await next_message(ws, "hello")
        assert hello["rate_hz"] == 4.0 and hello["source"] == "simulated"
        assert [d["uuid"] for d in hello["devices"]] == [WHOLE, MIG]
        first = await next_message(ws, "sample")
        second = await next_message(ws, "sample")
        assert second["sample"]["t"] > first["sample"]["t"]
        assert set(first["sample"]["devices"]) == {WHOLE, MIG}
    finally:
        ws.close()
    slow = await connect(lab, "?rate_hz=0.5")
    try:
        assert (await next_message(slow, "hello"))["rate_hz"] == 0.5
    finally:
        slow.close()


async def test_many_panels_do_not_multiply_nvml_calls(lab: LabServer) -> None:
    sockets = [await connect(lab, "?rate_hz=20") for _ in range(10)]
    try:
        for ws in sockets:
            await next_message(ws, "sample")
        stats = lab.get("stats").json()
        assert stats["clients"] == 10
        # memory is read from every device on every sample (process lists are not: a whole
        # GPU's is read every GPUMonitor.process_list_seconds)
        calls = stats["source_calls"]["nvmlDeviceGetMemoryInfo"]
        # the sampler may be mid-sample between the two counters: at most one sample apart
        assert stats["samples_taken"] * 2 <= calls <= (stats["samples_taken"] + 1) * 2
    finally:
        for ws in sockets:
            ws.close()


def test_metrics_are_prometheus_text_with_the_fixed_names(lab: LabServer) -> None:
    wait_for("a sample", lambda: lab.get("samples").json()["samples"], 20, 0.1)
    r = lab.get("metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert f'gpulab_gpu_utilization_ratio{{gpu="{WHOLE}",server="",user="ada"}} 0.5' in text
    for name in (
        "gpulab_gpu_memory_used_bytes",
        "gpulab_gpu_memory_limit_bytes",
        "gpulab_gpu_temperature_celsius",
        "gpulab_gpu_power_watts",
        "gpulab_gpu_process_memory_bytes",
    ):
        assert f"\n{name}{{" in text, name
    assert 'gpulab_monitor_simulated{gpu="",server="",user="ada"} 1.0' in text


async def test_panels_beyond_max_clients_are_refused_and_stopping_leaves_no_process(
    make_lab_server,
) -> None:
    server = make_lab_server(
        "lab2",
        env={"GPULAB_MONITOR_SOURCE": "simulated"},
        config=Config({"GPUMonitor": {"max_clients": 1}}),
    )
    try:
        assert server.get("devices").json()["devices"], "one simulated GPU by default"
        assert server.get("lag").status_code == 404, "loop-lag measurement is opt-in"
        first = await connect(server)
        await next_message(first, "hello")
        with pytest.raises(HTTPClientError) as e:
            await connect(server)
        assert e.value.code == 503
        first.close()
        assert pids_with_marker(server.marker)
    finally:
        server.stop()
    assert server.proc is not None and server.proc.returncode is not None
    assert pids_with_marker(server.marker) == []


def test_watching_gpu_figures_does_not_count_as_server_activity(lab: LabServer) -> None:
    before = lab.client.get("/api/status").json()["last_activity"]
    time.sleep(0.05)
    for path in ("devices", "samples", "metrics", "alerts", "rules", "stats"):
        assert lab.get(path).status_code == 200
    assert lab.client.get("/api/status").json()["last_activity"] == before


def test_rules_list_the_idle_default_and_its_prometheus_form(lab: LabServer) -> None:
    body = lab.get("rules").json()
    (idle,) = body["rules"]
    assert idle["name"] == "IDLE_GPU" and idle["source"] == "default" and idle["id"]
    assert idle["text"].startswith("IF gpu_utilization < 5% FOR 30m THEN alert(")
    assert "IDLE_GPU" in json.dumps(body["prometheus"])
    assert lab.request("DELETE", f"rules/{idle['id']}").status_code == 409


def test_an_invalid_rule_is_refused_with_its_position_and_nothing_is_saved(lab: LabServer) -> None:
    r = lab.request("POST", "rules", json={"text": 'IF gpu_utilization > 90 % THEN alrt("X")'})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["line"] == 1 and body["column"] > 1 and body["message"]
    assert lab.request("POST", "rules", json={"rule": "IF"}).status_code == 400
    assert [x["source"] for x in lab.get("rules").json()["rules"]] == ["default"]
    assert not (lab.home / ".gpulab" / "alert-rules.txt").exists()


async def test_a_rule_that_fires_reaches_the_websocket_alerts_and_metrics(
    lab: LabServer, figures: Path
) -> None:
    ws = await connect(lab, "?rate_hz=1")
    try:
        await next_message(ws, "hello")
        rule = 'IF gpu_utilization > 90% FOR 1s THEN alert("HOT_GPU", severity="critical")'
        r = lab.request("POST", "rules", json={"text": rule})
        assert r.status_code == 201, r.text
        created = r.json()["rule"]
        assert (created["name"], created["severity"], created["source"]) == (
            "HOT_GPU",
            "critical",
            "user",
        )
        assert "HOT_GPU" in (lab.home / ".gpulab" / "alert-rules.txt").read_text()

        set_figures(figures, {"*": {"utilization_pct": 50}, WHOLE: {"utilization_pct": 97}})
        fired = (await next_message(ws, "alert"))["event"]
        assert (fired["rule"], fired["state"], fired["device"]) == ("HOT_GPU", "firing", WHOLE)
        assert fired["severity"] == "critical" and fired["since"] <= fired["t"]

        alerts = lab.get("alerts").json()
        assert [(a["rule"], a["device"]) for a in alerts["active"]] == [("HOT_GPU", WHOLE)]
        assert any(e["state"] == "firing" for e in alerts["recent"])
        metrics = lab.get("metrics").text
        assert (
            f'gpulab_alert_active{{alert="HOT_GPU",gpu="{WHOLE}",server="",severity="critical",user="ada"}} 1.0'
            in metrics
        )

        set_figures(figures, {"*": {"utilization_pct": 20}})
        resolved = (await next_message(ws, "alert"))["event"]
        assert (resolved["state"], resolved["device"]) == ("resolved", WHOLE)
        assert lab.get("alerts").json()["active"] == []
        assert "gpulab_alert_active{" not in lab.get("metrics").text

        assert lab.request("DELETE", f"rules/{created['id']}").status_code == 204
        assert [x["name"] for x in lab.get("rules").json()["rules"]] == ["IDLE_GPU"]
        assert "HOT_GPU" not in (lab.home / ".gpulab" / "alert-rules.txt").read_text()
        assert lab.request("DELETE", f"rules/{created['id']}").status_code == 404
    finally:
        ws.close()
