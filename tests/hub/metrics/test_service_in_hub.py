"""gpulab-metrics on a real hub: real servers push their GPU figures; the service calls none."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from traitlets.config import Config

from tests.harness.hub import Hub, fast_metrics_env
from tests.harness.wait import wait_for

SERVICE = "/services/gpulab-metrics/"

# A jupyter server config for the spawned servers: every request they answer is written down
# with its path and Authorization header, so the test sees who called them with what token.
RECORDER = """
import os
from jupyter_server.log import log_request

def _record(handler):
    with open(os.environ["GPULAB_TEST_REQUEST_LOG"], "a") as f:
        f.write(handler.request.path + "\\t" + handler.request.headers.get("Authorization", "") + "\\n")
    log_request(handler)

c.ServerApp.tornado_settings = {"log_function": _record}  # jupyterhub-singleuser keeps it
"""


def service_token(hub: Hub) -> str:
    """The gpulab-metrics process's own hub token, read from its environment."""
    marker = f"127.0.0.1:{hub.hub_port}/hub/api".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(i.split(b"=", 1) for i in raw.split(b"\0") if b"=" in i)
        if env.get(b"JUPYTERHUB_SERVICE_NAME") == b"gpulab-metrics" and marker in raw:
            return env[b"JUPYTERHUB_API_TOKEN"].decode()
    raise AssertionError("no gpulab-metrics process for this hub")


@pytest.fixture
def metrics_hub(make_hub: Any, tmp_path: Path, shared_dir: Path) -> Hub:
    figures = shared_dir / "gpus.json"
    figures.write_text(json.dumps({"*": {"utilization_pct": 0}}))  # idle GPUs
    metrics_env = fast_metrics_env(
        tmp_path,
        "c.MetricsService.rules = 'IF gpu_utilization < 5% FOR 2s THEN alert(\"IDLE_GPU\")'\n",
    )
    recorder = shared_dir / "recorder" / "jupyter_server_config.py"
    recorder.parent.mkdir(mode=0o755)
    recorder.write_text(RECORDER)
    requests = shared_dir / "requests"
    requests.mkdir(mode=0o1777)
    os.chmod(requests, 0o1777)  # servers may run as their users' own accounts
    env = {
        "GPULAB_MONITOR_SOURCE": "simulated",
        "GPULAB_SIMULATED_GPU_FILE": str(figures),
        "JUPYTER_CONFIG_PATH": str(recorder.parent),
        "GPULAB_TEST_REQUEST_LOG": str(requests / "log.tsv"),
    }
    overlay = Config()
    overlay.Spawner.environment.update(env)
    hub = make_hub(
        overlay,
        env=metrics_env,
    )
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="gpu-1")
    hub.start_server("bob", profile="gpu-1")
    return hub


def recorded_requests(shared_dir: Path) -> list[tuple[str, str]]:
    path = shared_dir / "requests" / "log.tsv"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(line.split("\t", 1)) for line in lines]  # type: ignore[misc]


def test_two_users_servers_push_and_admins_see_both_with_the_hubs_labels(
    metrics_hub: Hub,
) -> None:
    hub = metrics_hub
    admin = httpx.Client(
        base_url=f"{hub.url}{SERVICE}",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )

    def pushed() -> dict[str, dict[str, Any]] | None:
        r = admin.get("api/servers")
        if r.status_code != 200:
            return None
        up = {s["user"]: s for s in r.json()["servers"] if s["up"] and s["gpus"]}
        return up if set(up) == {"alice", "bob"} else None

    servers = wait_for("both servers' pushes", pushed, 90, 0.5)
    for user in ("alice", "bob"):
        assert servers[user]["server"] == "" and servers[user]["error"] == ""
        [gpu] = servers[user]["gpus"]
        assert gpu["utilization_pct"] == 0 and gpu["memory_limit_mib"] > 0
    [alice_gpu] = servers["alice"]["gpus"]

    r = admin.get("metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for mf in text_string_to_metric_families(r.text)
        for s in mf.samples
    }
    for user, server in servers.items():
        labels = (("gpu", server["gpus"][0]["gpu"]), ("server", ""), ("user", user))
        assert samples[("gpulab_gpu_utilization_ratio", labels)] == 0
        assert samples[("gpulab_scrape_up", (("server", ""), ("user", user)))] == 1

    # bob's own server token, claiming alice's server: refused, and alice's figures stay hers
    bob_token = hub.server_env("bob")["JUPYTERHUB_API_TOKEN"]
    push_url = hub.server_env("bob")["GPULAB_METRICS_PUSH_URL"]
    forged = (
        "# TYPE gpulab_gpu_utilization_ratio gauge\n"
        f'gpulab_gpu_utilization_ratio{{gpu="{alice_gpu["gpu"]}",user="alice",server=""}} 0.99\n'
    )
    refusals = admin.get("api/servers").json()["push_refusals_total"]
    r = httpx.post(
        f"{push_url}/alice",
        content=forged,
        headers={"Authorization": f"token {bob_token}"},
        timeout=30,
    )
    assert r.status_code == 403, r.text
    assert r.json()["message"] == "a token of 'bob' cannot report for a server of 'alice'"
    body = admin.get("api/servers").json()
    assert body["push_refusals_total"] == refusals + 1
    alice = next(s for s in body["servers"] if s["user"] == "alice")
    assert [g["utilization_pct"] for g in alice["gpus"]] == [0]
    # nor can bob's token report for a server of his own that does not run
    r = httpx.post(
        f"{push_url}/bob/other",
        content=forged,
        headers={"Authorization": f"token {bob_token}"},
        timeout=30,
    )
    assert r.status_code == 403, r.text

    def idle() -> list[dict[str, Any]]:
        entries = admin.get("api/alerts").json()["idle_gpu_servers"]
        return entries if len(entries) == 2 else []

    entries = wait_for("both idle alerts", idle, 90, 0.5)
    assert sorted((e["user"], e["server"]) for e in entries) == [("alice", ""), ("bob", "")]

    # pushing is not using the server: its last activity stays put, so idle culling still works
    # (the hub reads the proxy's activity every 2 s here: c.JupyterHub.last_activity_interval)
    before = hub.server_model("alice")["last_activity"]
    pushes = next(s for s in admin.get("api/servers").json()["servers"] if s["user"] == "alice")
    wait_for(
        "five more pushes from alice",
        lambda: (
            next(s for s in admin.get("api/servers").json()["servers"] if s["user"] == "alice")[
                "pushes"
            ]
            >= pushes["pushes"] + 5
        ),
        90,
        0.5,
    )
    time.sleep(2.5)  # one more activity poll by the hub after those pushes
    assert hub.server_model("alice")["last_activity"] == before

    # a plain user's own token identifies her, but she is no admin: 403 everywhere
    r = hub.api("POST", "/users/alice/tokens", json={"note": "metrics test"})
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
    assert r.status_code == 200 and len(r.json()["idle_gpu_servers"]) == 2
    browser.close()

    # alice's server stops: it leaves the service's view and her alert resolves; bob's stays
    hub.stop_server("alice")
    wait_for(
        "bob's server alone listed",
        lambda: [s["user"] for s in admin.get("api/servers").json()["servers"]] == ["bob"],
        90,
        0.5,
    )
    body = admin.get("api/alerts").json()
    assert [a["user"] for a in body["alerts"]] == ["bob"]
    assert [(e["user"], e["state"]) for e in body["recent"] if e["user"] == "alice"] == [
        ("alice", "firing"),
        ("alice", "resolved"),
    ]
    admin.close()


def test_no_request_from_the_service_reaches_a_user_server(
    metrics_hub: Hub, shared_dir: Path
) -> None:
    hub = metrics_hub
    token = service_token(hub)
    admin = httpx.Client(
        base_url=f"{hub.url}{SERVICE}", headers={"Authorization": f"token {hub.token}"}, timeout=30
    )

    def both_pushed_three_times() -> bool:
        servers = admin.get("api/servers").json()["servers"]
        return len(servers) == 2 and all(s["pushes"] >= 3 for s in servers)

    wait_for("three pushes from both", both_pushed_three_times, 90, 0.5)
    admin.close()
    # the recorder works: a request with a token that may open alice's server is written down
    r = httpx.get(
        f"{hub.url}/user/alice/api/status",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    # the server writes its record as the request ends, which may be after the client has the answer
    probe = ("/user/alice/api/status", f"token {hub.token}")
    wait_for(
        "the recorder to write the probe", lambda: probe in recorded_requests(shared_dir), 15, 0.2
    )
    seen = recorded_requests(shared_dir)
    # while both servers pushed, neither saw the service's token, nor any scrape
    assert not [path for path, auth in seen if token in auth]
    assert not [path for path, _ in seen if "gpulab/monitor" in path]

    # the service's role: which servers run, nothing that reaches one, no proxy
    r = httpx.get(
        f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    scopes = set(r.json()["scopes"])
    assert {"list:users", "read:servers"} <= scopes
    assert not {s for s in scopes if s.startswith(("access:servers", "proxy", "admin"))}
    # so its token opens no server
    r = httpx.get(
        f"{hub.url}/user/alice/api/status",
        headers={"Authorization": f"token {token}"},
        timeout=30,
        follow_redirects=False,
    )
    assert r.status_code == 403, (r.status_code, r.text)


def test_the_service_can_be_switched_off(make_hub):
    hub = make_hub(env={"GPULAB_METRICS_SERVICE": "0"})
    services = hub.api("GET", "/services").json()
    assert "gpulab-metrics" not in services
    assert "Starting service 'gpulab-metrics'" not in hub.log()
    hub.create_user("ada")
    hub.start_server("ada")
    assert "GPULAB_METRICS_PUSH_URL" not in hub.server_env("ada")
