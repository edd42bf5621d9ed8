"""`gpulab.hub.config.apply(c)` makes a hub with any authenticator a gpulab hub.

A cluster deployment logs people in with OAuthenticator or the like, not gpulab's own
authenticator. Here the hub uses JupyterHub's DummyAuthenticator: gpulab's REST endpoints, the
workspaces page and the checks in front of JupyterHub's server handlers must all be there, because
`apply(c)` (which the shipped config calls last) registered them, not the authenticator.
"""

from __future__ import annotations

import pytest
from jupyterhub.auth import DummyAuthenticator
from traitlets.config import Config

from gpulab.hub.config import GPULab, GPULabHubHooks, apply, authenticator_class, with_hub_hooks
from gpulab.hub.handlers.servers import server_handler_overrides

DUMMY = Config(
    JupyterHub={"authenticator_class": "dummy"},
    DummyAuthenticator={"password": "a-shared-test-password"},
    Authenticator={"admin_users": {"admin"}, "allow_all": True},
    GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"},
)


def test_apply_extends_the_configured_authenticator_and_adds_the_handlers() -> None:
    c = Config()
    c.JupyterHub.authenticator_class = "dummy"
    apply(c)
    cls = c.JupyterHub.authenticator_class
    assert issubclass(cls, DummyAuthenticator) and issubclass(cls, GPULabHubHooks)
    assert cls.__name__ == "DummyAuthenticator"  # c.DummyAuthenticator settings still apply
    routes = [route for route, *_ in c.JupyterHub.extra_handlers]
    assert "/api/gpulab/capacity" in routes and "/gpulab/workspaces" in routes
    apply(c)  # a second call adds nothing twice
    assert [route for route, *_ in c.JupyterHub.extra_handlers] == routes
    assert c.JupyterHub.authenticator_class is cls


def test_gpulab_options_decide_the_services_and_where_servers_push() -> None:
    c = Config()
    c.JupyterHub.services = [{"name": "admins-own", "api_token": "x" * 32}]
    c.Spawner.environment = {"ADMINS_OWN": "1"}
    c.GPULab.cull_idle_seconds = 600
    c.GPULab.metrics_service_url = "http://127.0.0.1:8002"
    c.GPULab.metrics_push_interval_seconds = 5
    apply(c)
    services = {s["name"]: s for s in c.JupyterHub.services}
    assert set(services) == {"admins-own", "idle-culler", "gpulab-metrics"}
    assert "--timeout=600" in services["idle-culler"]["command"]
    assert services["gpulab-metrics"]["url"] == "http://127.0.0.1:8002"
    roles = {r["name"]: r["scopes"] for r in c.JupyterHub.load_roles}
    assert roles["gpulab-metrics"] == ["list:users", "read:users", "read:servers"]
    assert c.Spawner.environment == {
        "ADMINS_OWN": "1",
        "GPULAB_METRICS_PUSH_URL": "http://127.0.0.1:8002/api/push",
        "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "5",
    }

    off = Config()
    off.GPULab.cull_idle_seconds = 0
    off.GPULab.metrics_service = False
    apply(off)
    assert "services" not in off.JupyterHub and "environment" not in off.Spawner


def test_every_gpulab_option_has_help() -> None:
    traits = GPULab.class_traits(config=True)
    assert traits and all(len(trait.help) > 40 for trait in traits.values())


def test_the_authenticator_routes_gpulab_server_checks_first() -> None:
    cls = with_hub_hooks(DummyAuthenticator)
    handlers = cls.get_handlers(cls.__new__(cls), app=None)
    assert handlers[: len(server_handler_overrides)] == server_handler_overrides


def test_an_unknown_authenticator_name_is_refused_with_the_option() -> None:
    with pytest.raises(ValueError, match="JupyterHub.authenticator_class 'no-such-thing'"):
        authenticator_class("no-such-thing")


def test_a_hub_with_dummy_authenticator_serves_capacity_and_the_workspaces_page(make_hub):
    hub = make_hub(DUMMY)
    assert "Using Authenticator: jupyterhub.auth.DummyAuthenticator" in hub.log()
    hub.create_user("alice")

    r = hub.api("GET", "/gpulab/capacity")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["inventory"].startswith("declared: 2 x A100-SXM4-80GB")
    assert {p["slug"] for p in body["profiles"]} >= {"cpu", "gpu-1"}

    alice = hub.login("alice", "a-shared-test-password")
    page = alice.get("/hub/gpulab/workspaces")
    assert page.status_code == 200, page.text[:500]
    assert "Workspaces" in page.text and "alice" in page.text


def test_a_refused_first_start_leaves_no_record_under_another_authenticator(make_hub):
    hub = make_hub(DUMMY)
    hub.create_user("alice")
    r = hub.api("POST", "/users/alice/servers/exp", json={"profile": "no-such-profile"})
    assert 400 <= r.status_code < 500, r.text
    r = hub.api("GET", "/users/alice", params={"include_stopped_servers": "1"})
    assert "exp" not in r.json()["servers"]
    # and the reserved name is refused before any record exists, as with gpulab's authenticator
    r = hub.api("POST", "/users/alice/servers/default", json={"profile": "cpu"})
    assert r.status_code == 400 and "reserved" in r.json()["message"]


def test_a_broken_gpu_configuration_stops_a_hub_with_another_authenticator(make_hub):
    broken = Config(DUMMY)
    broken.GPUCapacity.profiles = [{"slug": "odd", "gpus": "1/3"}]
    hub = make_hub(broken, start=False)
    hub.start(expect_failure=True)
    assert hub.wait_exit() != 0
    assert "gpulab configuration error" in hub.log()
