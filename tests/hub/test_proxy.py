"""The hub's proxy (gpulab.hub.proxy) in a real hub: each running server has a VS Code route of its
own that names no user (so its traffic is no activity), kept by the hub's route check and gone
with the server."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
from traitlets.config import Config

from gpulab.hub.proxy import VSCODE_ROUTE_KEY
from tests.harness.wait import wait_for


def test_a_running_server_has_a_vscode_route_of_its_own_that_is_no_users_activity(
    make_hub: Any,
) -> None:
    token = secrets.token_hex(16)
    hub = make_hub(
        Config(GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"}),
        env={"CONFIGPROXY_AUTH_TOKEN": token},
    )
    proxy = httpx.Client(
        base_url=f"http://127.0.0.1:{hub.proxy_api_port}/api/routes",
        headers={"Authorization": f"token {token}"},
        timeout=30,
    )
    hub.create_user("alice")
    hub.start_server("alice", profile="gpu-eighth")
    routes = proxy.get("").json()
    own, vscode = routes["/user/alice"], routes["/user/alice/vscode"]
    assert vscode["target"] == own["target"]  # the same server, behind the same auth
    assert "user" not in vscode and vscode[VSCODE_ROUTE_KEY] == "alice/"

    # gone from the proxy (a proxy restart, a lost update): the hub's route check adds it again
    assert proxy.delete("/user/alice/vscode").status_code == 204
    wait_for(
        "the route check to restore it",
        lambda: "/user/alice/vscode" in proxy.get("").json(),
        30,
        0.5,
    )
    # one the hub left behind for a server that is gone is deleted by the same check
    stale = {"target": own["target"], VSCODE_ROUTE_KEY: "nobody/", "jupyterhub": True}
    r = proxy.post("/user/nobody/vscode", json=stale)
    assert r.status_code == 201
    wait_for(
        "the stale route to go",
        lambda: "/user/nobody/vscode" not in proxy.get("").json() or None,
        30,
        0.5,
    )

    hub.stop_server("alice")
    wait_for(
        "her routes to go",
        lambda: not any(p.startswith("/user/alice") for p in proxy.get("").json()) or None,
        30,
        0.5,
    )
