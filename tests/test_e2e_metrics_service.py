"""gpulab-metrics on a real hub: it scrapes a real server's GPU monitor through the proxy."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hubtools import free_port

pytestmark = pytest.mark.e2e

SERVICE = "/services/gpulab-metrics/"


def wait_for(fetch: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fetch()
        if last:
            return last
        time.sleep(0.5)
    raise TimeoutError(f"condition not met; last: {last!r}")


def test_service_scrapes_a_real_server_and_serves_admins_only(make_hub, tmp_path: Path):
    figures = tmp_path / "gpus.json"
    figures.write_text(json.dumps({"*": {"utilization_pct": 0}}))  # an idle GPU
    config = tmp_path / "metrics_config.py"
    config.write_text(
        "c.MetricsService.scrape_interval_seconds = 1\n"
        "c.MetricsService.rules = 'IF gpu_utilization < 5% FOR 2s THEN alert(\"IDLE_GPU\")'\n"
    )
    hub = make_hub(
        "c.Spawner.environment = {'GPULAB_MONITOR_SOURCE': 'simulated',"
        f" 'GPULAB_SIMULATED_GPU_FILE': {str(figures)!r}}}\n",
        env={
            "GPULAB_METRICS_SERVICE_PORT": str(free_port()),
            "GPULAB_METRICS_CONFIG": str(config),
        },
    )
    hub.create_user("ada")
    hub.start_server("ada", profile="gpu-1")
    admin = httpx.Client(
        base_url=f"{hub.url}{SERVICE}",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )

    def ada_server() -> dict[str, Any] | None:
        r = admin.get("api/servers")
        if r.status_code != 200:
            return None
        servers = [s for s in r.json()["servers"] if s["user"] == "ada" and s["up"]]
        return servers[0] if servers and servers[0]["gpus"] else None

    server = wait_for(ada_server)
    assert server["server"] == "" and server["error"] == ""
    [gpu] = server["gpus"]
    assert gpu["utilization_pct"] == 0 and gpu["memory_limit_mib"] > 0

    def idle() -> list[dict[str, Any]]:
        return admin.get("api/alerts").json()["idle_gpu_servers"]

    [entry] = wait_for(idle)
    assert (entry["user"], entry["server"], entry["gpus"]) == ("ada", "", [gpu["gpu"]])
    alerts = admin.get("api/alerts").json()["alerts"]
    assert [(a["rule"], a["user"], a["gpu"]) for a in alerts] == [("IDLE_GPU", "ada", gpu["gpu"])]

    # scraping is not using the server: its last activity stays put, so idle culling still works
    # (the hub reads the proxy's activity every 2 s here: c.JupyterHub.last_activity_interval)
    before = hub.server_model("ada")["last_activity"]
    cycles = admin.get("api/servers").json()["cycles"]
    wait_for(lambda: admin.get("api/servers").json()["cycles"] >= cycles + 5)
    time.sleep(2.5)  # one more activity poll by the hub after those scrapes
    assert hub.server_model("ada")["last_activity"] == before

    r = admin.get("metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for mf in text_string_to_metric_families(r.text)
        for s in mf.samples
    }
    labels = (("gpu", gpu["gpu"]), ("server", ""), ("user", "ada"))
    assert samples[("gpulab_gpu_utilization_ratio", labels)] == 0
    assert samples[("gpulab_scrape_up", (("server", ""), ("user", "ada")))] == 1
    alert_labels = (("alert", "IDLE_GPU"), ("gpu", gpu["gpu"]), ("server", ""))
    assert (
        samples[
            ("gpulab_hub_alert_active", (*alert_labels, ("severity", "warning"), ("user", "ada")))
        ]
        == 1
    )

    # a plain user's own token identifies her, but she is no admin: 403 everywhere
    r = hub.api("POST", "/users/ada/tokens", json={"note": "metrics test"})
    assert r.status_code == 201, r.text
    user_token = r.json()["token"]
    for path in ("api/alerts", "api/servers", "metrics"):
        r = httpx.get(
            f"{hub.url}{SERVICE}{path}",
            headers={"Authorization": f"token {user_token}"},
            timeout=30,
        )
        assert r.status_code == 403, (path, r.status_code, r.text)
        assert "not an admin" in r.json()["message"]
    r = httpx.get(f"{hub.url}{SERVICE}api/alerts", timeout=30)
    assert r.status_code == 403 and "admin" in r.json()["message"]

    # an admin user's token answers; the same admin's token scoped down to less does not
    full = hub.api("POST", "/users/admin/tokens", json={"note": "full"}).json()["token"]
    narrow = hub.api(
        "POST", "/users/admin/tokens", json={"note": "narrow", "scopes": ["read:users:name!user"]}
    ).json()["token"]
    for token, status in ((full, 200), (narrow, 403)):
        r = httpx.get(
            f"{hub.url}{SERVICE}api/servers",
            headers={"Authorization": f"token {token}"},
            timeout=30,
        )
        assert r.status_code == status, (status, r.text)

    # an admin in a browser: the service's page sends her through the hub's OAuth login once
    browser = hub.login("admin", hub.admin_password())
    r = browser.get(SERVICE)
    assert r.status_code == 200 and r.json()["service"] == "gpulab-metrics", r.text
    r = browser.get(f"{SERVICE}api/alerts")
    assert r.status_code == 200 and r.json()["idle_gpu_servers"][0]["user"] == "ada"
    browser.close()

    # the server stops: it leaves the service's view and its alert resolves
    hub.stop_server("ada")
    wait_for(lambda: admin.get("api/servers").json()["servers"] == [])
    body = admin.get("api/alerts").json()
    assert body["alerts"] == [] and body["idle_gpu_servers"] == []
    assert [e["state"] for e in body["recent"]] == ["firing", "resolved"]
    admin.close()


def test_the_service_can_be_switched_off(make_hub):
    hub = make_hub(env={"GPULAB_METRICS_SERVICE": "0"})
    services = hub.api("GET", "/services").json()
    assert "gpulab-metrics" not in services
    assert "Starting service 'gpulab-metrics'" not in hub.log()
