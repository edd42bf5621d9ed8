"""`gpulab.hub.config.apply(c)` makes a hub with any authenticator a gpulab hub.

A cluster deployment logs people in with OAuthenticator or the like, not gpulab's own
authenticator. Here the hub uses JupyterHub's DummyAuthenticator: gpulab's REST endpoints, the
workspaces page and the checks in front of JupyterHub's server handlers must all be there, because
`apply(c)` (which the shipped config calls last) registered them, not the authenticator.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from jupyterhub.auth import DummyAuthenticator
from traitlets import TraitError
from traitlets.config import Config

from gpulab.hub.config import (
    TEMPLATES,
    GPULab,
    GPULabHubHooks,
    apply,
    authenticator_class,
    with_hub_hooks,
)
from gpulab.hub.daskservice.hub import post_stop_hook
from gpulab.hub.handlers.servers import server_handler_overrides
from gpulab.hub.scopes import ADMIN_READ, ALLOCATIONS_READ, DASK, PREEMPT, REPORT_GPU, USAGE
from tests.harness.hub import REPO, merged

JUPYTERHUB = Path(sys.executable).parent / "jupyterhub"

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


def test_apply_adds_the_templates_and_custom_scopes_after_the_admins_own() -> None:
    c = Config()
    c.JupyterHub.template_paths = ["/srv/own-templates"]
    c.JupyterHub.custom_scopes = {"custom:own:thing": {"description": "an admin's own scope"}}
    apply(c)
    apply(c)
    assert c.JupyterHub.template_paths == ["/srv/own-templates", str(TEMPLATES)]
    assert set(c.JupyterHub.custom_scopes) == {
        "custom:own:thing",
        ALLOCATIONS_READ,
        DASK,
        ADMIN_READ,
        PREEMPT,
        USAGE,
        REPORT_GPU,
    }


def test_servers_tokens_get_the_job_scopes_on_their_owner_unless_the_admin_chose() -> None:
    c = Config()
    apply(c)
    assert c.Spawner.server_token_scopes == [
        "access:servers!server",
        "users:activity!user",
        "read:servers!user",
        "servers!user",
        "custom:gpulab:dask!user",
        "custom:gpulab:usage!user",
    ]
    own = Config()
    own.Spawner.server_token_scopes = ["access:servers!server", "users:activity!user"]
    apply(own)
    assert own.Spawner.server_token_scopes == ["access:servers!server", "users:activity!user"]


def test_every_user_manages_her_dask_clusters_and_a_stopped_server_stops_its_own() -> None:
    c = Config()
    c.JupyterHub.extra_user_scopes = ["read:groups"]
    apply(c)
    apply(c)  # nothing twice
    # every user may hold her own workloads' report scope (the hub narrows each token to one)
    assert c.JupyterHub.extra_user_scopes == [
        "read:groups",
        f"{DASK}!user",
        f"{USAGE}!user",
        f"{REPORT_GPU}!user",
    ]
    assert c.Spawner.post_stop_hook is post_stop_hook
    # an admin's own hook runs too, first
    calls: list[str] = []
    own = Config()
    own.Spawner.post_stop_hook = lambda spawner: calls.append(spawner)
    apply(own)
    apply(own)
    hook = own.Spawner.post_stop_hook
    assert hook is not post_stop_hook and getattr(hook, "gpulab_dask", False)
    # no hub runs here: the cluster service is not there, and a server's stop goes on anyway
    spawner = SimpleNamespace(
        config=Config(GPUDask={"enabled": False}),
        log=logging.getLogger("test"),
        user=SimpleNamespace(name="alice"),
        name="",
        _log_name="alice",
    )
    asyncio.run(hook(spawner))
    assert calls == [spawner]


def test_help_all_lists_every_gpulab_configurable_class(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(JUPYTERHUB), "-f", str(REPO / "hub" / "jupyterhub_config.py"), "--help-all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    listed = {line.split("(")[0] for line in out.splitlines() if line.endswith(") options")}
    gpulab = {"GPUCapacity", "GPULab", "GPULabAuthenticator", "GPULocalSpawner"}
    gpulab |= {"GPUSimpleLocalSpawner", "GPUKubeSpawner"}
    assert gpulab <= listed, gpulab - listed
    assert "--GPULab.cull_idle_seconds" in out and "--GPUCapacity.profiles" in out


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
    # which servers run and which job runs and Dask workers hold shares; nothing that acts
    assert roles["gpulab-metrics"] == ["list:users", "read:users", "read:servers", ALLOCATIONS_READ]
    assert c.Spawner.environment == {
        "ADMINS_OWN": "1",
        "GPULAB_METRICS_PUSH_URL": "http://127.0.0.1:8002/api/push",
        "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "5",
        "GPULAB_MONITOR_SOURCE": "auto",
    }

    off = Config()
    off.GPULab.cull_idle_seconds = 0
    off.GPULab.metrics_service = False
    off.GPULab.monitor_source = "none"
    apply(off)
    assert "services" not in off.JupyterHub
    assert spawner_environment(off) == {"GPULAB_MONITOR_SOURCE": "none"}


def spawner_environment(c: Config) -> dict:
    """c.Spawner.environment, resolved where .update() left traitlets' lazy value."""
    env = c.Spawner.environment
    return env if isinstance(env, dict) else env.get_value({})


def test_the_monitor_source_is_a_hub_setting_checked_by_name() -> None:
    c = Config()
    c.GPULab.monitor_source = "simulated"
    apply(c)
    assert spawner_environment(c)["GPULAB_MONITOR_SOURCE"] == "simulated"
    admins = Config()
    admins.Spawner.environment.update({"GPULAB_MONITOR_SOURCE": "nvml"})  # the admin's own wins
    apply(admins)
    assert spawner_environment(admins)["GPULAB_MONITOR_SOURCE"] == "nvml"
    bad = Config()
    bad.GPULab.monitor_source = "dcgm"
    with pytest.raises(
        TraitError, match="'monitor_source' trait of a GPULab instance expected any"
    ):
        apply(bad)


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
    broken = merged(DUMMY)  # a copy: DUMMY stays as other tests use it
    broken.GPUCapacity.profiles = [{"slug": "odd", "gpus": "1/3"}]
    hub = make_hub(broken, start=False)
    hub.start(expect_failure=True)
    assert hub.wait_exit() != 0
    assert "gpulab configuration error" in hub.log()


def test_allocations_are_for_admins_and_holders_of_gpulabs_read_scope(make_hub):
    overlay = merged(DUMMY)
    overlay.JupyterHub.services.extend([{"name": "reader", "api_token": "r" * 32}])
    overlay.JupyterHub.load_roles.extend(
        [{"name": "allocations-reader", "services": ["reader"], "scopes": [ALLOCATIONS_READ]}]
    )
    hub = make_hub(overlay)
    hub.create_user("alice")

    assert hub.api("GET", "/gpulab/allocations").status_code == 200  # admin:users
    reader = httpx.Client(
        base_url=f"{hub.url}/hub/api", headers={"Authorization": "token " + "r" * 32}
    )
    r = reader.get("/gpulab/allocations")
    assert r.status_code == 200, r.text
    assert "allocations" in r.json()
    assert reader.get("/users").status_code == 403  # that scope and nothing more

    alice = hub.login("alice", "a-shared-test-password")
    assert alice.get("/hub/api/gpulab/allocations").status_code == 403
    assert alice.get("/hub/api/gpulab/capacity").status_code == 200


def test_workspace_actions_follow_jupyterhubs_server_scopes(make_hub):
    # read:servers lists snapshots, servers takes/restores/clones them; granted by any role
    overlay = merged(DUMMY)
    overlay.JupyterHub.services.extend([{"name": "lister", "api_token": "l" * 32}])
    overlay.JupyterHub.load_roles.extend(
        [{"name": "snapshot-lister", "services": ["lister"], "scopes": ["read:servers"]}]
    )
    hub = make_hub(overlay)
    hub.create_user("alice")
    hub.create_user("eve")
    lister = httpx.Client(
        base_url=f"{hub.url}/hub/api", headers={"Authorization": "token " + "l" * 32}
    )
    r = lister.get("/gpulab/users/alice/snapshots")
    assert r.status_code == 200 and r.json()["snapshots"] == [], r.text
    r = lister.post("/gpulab/users/alice/snapshots")
    assert r.status_code == 403 and "lack the scope 'servers'" in r.json()["message"], r.text
    assert lister.get("/gpulab/users/nobody/snapshots").status_code == 404

    eve = hub.login("eve", "a-shared-test-password")
    assert eve.get("/hub/api/gpulab/users/alice/snapshots").status_code == 403
    assert eve.get("/hub/api/gpulab/users/nobody/snapshots").status_code == 403  # no probing
    assert eve.get("/hub/api/gpulab/users/eve/snapshots").status_code == 200
