"""Server names and records through a real hub: the reserved name `default`, homes a renamed server
keeps, and refused first starts that leave no record counting against the named-server limit."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from traitlets.config import Config

from tests.harness.hub import merged

TWO_A100 = Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"})
LIMIT_2 = Config(JupyterHub={"named_server_limit_per_user": 2})


def _servers(hub, user: str) -> dict[str, dict]:
    """Every server record of `user`, stopped ones included."""
    r = hub.api("GET", f"/users/{user}", params={"include_stopped_servers": "1"})
    assert r.status_code == 200, r.text
    return r.json()["servers"]


def test_a_named_server_called_default_is_refused_before_any_record_exists(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    message = "The server name 'default' is reserved: it is the default server's home"
    for method in ("POST", "PUT"):
        r = hub.api(method, "/users/alice/servers/default", json={"profile": "cpu"})
        assert r.status_code == 400, (method, r.text)
        assert r.json()["message"] == message
    assert "default" not in _servers(hub, "alice")
    assert hub.allocations() == {}
    assert not hub.home("alice", "default").exists()

    # the spawn form refuses it too (JupyterHub's page shows the message)
    admin = hub.login("admin", hub.admin_password())
    xsrf = admin.cookies.get("_xsrf", path="/hub/")
    r = admin.post("/hub/spawn/admin/default", data={"profile": "cpu", "_xsrf": xsrf})
    assert r.status_code == 400
    assert "The server name &#39;default&#39; is reserved" in r.text
    assert "default" not in _servers(hub, "admin")

    # and so does renaming a server to it
    hub.api("PUT", "/users/alice/servers/scratch")
    r = hub.api("PATCH", "/users/alice/servers/scratch", json={"name": "default"})
    assert r.status_code == 400 and r.json()["message"] == message
    assert set(_servers(hub, "alice")) - {""} == {"scratch"}


def test_server_names_of_job_runs_and_dask_workers_are_refused(make_hub):
    # a server's allocation id is "<user>/<name>": "alice/job-3" is her job run 3's, and
    # "alice/dask-1-w0" her Dask worker's (their GPU reports go by these names too)
    hub = make_hub()
    hub.create_user("alice")
    for name in ("job-3", "dask-1-w0"):
        r = hub.api("POST", f"/users/alice/servers/{name}", json={"profile": "cpu"})
        assert r.status_code == 400, r.text
        assert r.json()["message"] == (
            f"The server name {name!r} is reserved: names like job-<n> and dask-<n>-w<n> are"
            " gpulab's job runs and Dask workers"
        )
    hub.api("PUT", "/users/alice/servers/scratch")
    r = hub.api("PATCH", "/users/alice/servers/scratch", json={"name": "job-3"})
    assert r.status_code == 400 and "is reserved" in r.json()["message"]
    assert set(_servers(hub, "alice")) - {""} == {"scratch"}
    assert hub.allocations() == {}
    # names that only look alike are fine
    r = hub.api("POST", "/users/alice/servers/job-three", json={"profile": "cpu"})
    assert r.status_code in (201, 202), r.text


def test_a_renamed_server_keeps_its_home_and_its_old_name_stays_taken(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.start_server("alice", "train")
    (hub.home("alice", "train") / "weights.txt").write_text("w\n")
    hub.stop_server("alice", "train")
    r = hub.api("PATCH", "/users/alice/servers/train", json={"name": "train-v1"})
    assert r.status_code == 200, r.text

    r = hub.spawn("alice", "train", profile="cpu")
    assert r.status_code == 400
    assert r.json()["message"] == (
        "The server name 'train' is taken: it is the home of alice's server 'train-v1' "
        "(a renamed server keeps its home); pick another name"
    )
    assert set(_servers(hub, "alice")) - {""} == {"train-v1"}
    # the renamed server still starts in its home
    hub.start_server("alice", "train-v1")
    assert hub.server_env("alice", "train-v1")["HOME"] == str(hub.home("alice", "train"))

    # the default server cannot be renamed: a new default server would share home 'default'
    r = hub.api("PATCH", "/users/alice/server", json={"name": "old-default"})
    assert r.status_code == 400
    assert r.json()["message"].startswith("The default server cannot be renamed")
    assert "old-default" not in _servers(hub, "alice")


@pytest.mark.parametrize(
    ("options", "status", "message"),
    [
        ({"profile": "gpu-17"}, 400, "Unknown profile 'gpu-17'"),
        ({"profile": "gpu-2"}, 403, "GPU quota exceeded: User 'bob' asks for 2 GPUs"),
        ({"profile": "gpu-8"}, 409, "Profile '8 GPUs' asks for more than any machine here"),
    ],
    ids=["unknown-profile", "over-quota", "larger-than-the-machine"],
)
def test_refused_first_starts_leave_no_record_and_do_not_count_against_the_limit(
    make_hub, options, status, message
):
    hub = make_hub(merged(TWO_A100, LIMIT_2))
    hub.create_user("bob")
    for name in ("a", "b", "c"):
        r = hub.spawn("bob", name, **options)
        assert r.status_code == status, r.text
        assert r.json()["message"].startswith(message)
    assert set(_servers(hub, "bob")) == {""}  # the default server's record JupyterHub made
    assert hub.allocations() == {}
    # two named servers may still be created: nothing counted the refused ones
    hub.start_server("bob", "x", profile="cpu")
    hub.start_server("bob", "y", profile="cpu")
    r = hub.spawn("bob", "z", profile="cpu")
    assert r.status_code == 400 and "already has the maximum of 2 named servers" in r.text


def test_a_refused_start_of_a_server_that_ran_keeps_its_record(make_hub):
    hub = make_hub(TWO_A100)
    hub.create_user("bob")
    hub.start_server("bob", "keep", profile="cpu")
    hub.stop_server("bob", "keep")
    r = hub.spawn("bob", "keep", profile="gpu-17")
    assert r.status_code == 400
    assert "keep" in _servers(hub, "bob")

    # the same through the spawn form: shown, started, stopped, then a refused start
    admin = hub.login("admin", hub.admin_password())
    assert admin.get("/hub/spawn/admin/mine").status_code == 200
    xsrf = admin.cookies.get("_xsrf", path="/hub/")
    r = admin.post("/hub/spawn/admin/mine", data={"profile": "cpu", "_xsrf": xsrf})
    assert r.status_code == 200, r.text[-2000:]
    hub.wait_ready("admin", "mine")
    hub.stop_server("admin", "mine")
    r = admin.post("/hub/spawn/admin/mine", data={"profile": "gpu-8", "_xsrf": xsrf})
    assert r.status_code == 409 and "asks for more than any machine here has" in r.text
    assert "mine" in _servers(hub, "admin")


def test_a_first_start_refused_in_the_background_is_forgotten_once_reported(make_hub):
    # slow_spawn_timeout 0: JupyterHub answers 202 at once and the refusal comes later, as for a
    # spawn that waits in the queue and times out
    overlay = merged(TWO_A100, LIMIT_2)
    overlay.JupyterHub.tornado_settings.update({"slow_spawn_timeout": 0})
    hub = make_hub(overlay)
    admin = hub.login("admin", hub.admin_password())
    xsrf = admin.cookies.get("_xsrf", path="/hub/")
    r = admin.post("/hub/spawn/admin/big", data={"profile": "gpu-2", "_xsrf": xsrf})
    # the form's POST waits a second for the start, then sends the person to the pending page
    deadline = time.monotonic() + 30
    page = r
    while time.monotonic() < deadline and "GPU quota exceeded" not in page.text:
        # the pending page: the start is still running, or it has been refused
        page = admin.get("/hub/spawn-pending/admin/big")
        time.sleep(0.5)
    assert "GPU quota exceeded: User &#39;admin&#39; asks for 2 GPUs" in page.text
    assert "big" not in _servers(hub, "admin")

    # over the API: 202, then the refusal; the record goes before the next server is counted
    for name in ("c", "d"):
        r = hub.spawn("admin", name, profile="gpu-2")
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (_servers(hub, "admin").get(name) or {}).get(
            "pending"
        ):
            time.sleep(0.3)
    hub.start_server("admin", "x", profile="cpu")
    hub.start_server("admin", "y", profile="cpu")
    assert set(_servers(hub, "admin")) == {"", "x", "y"}


async def test_a_refusal_waits_for_jupyterhub_to_end_the_start_before_forgetting_its_record():
    # JupyterHub clears a failed start's pending flag in a done-callback of its spawn future, a
    # later turn of the loop than the one that hands the refusal over; the same order is built
    # here with JupyterHub's own Spawner (a refused start that never reached an await)
    import asyncio
    from types import SimpleNamespace

    from jupyterhub.spawner import LocalProcessSpawner

    from gpulab.hub.handlers.servers import forget_refused_start, forget_unstarted_server

    spawner = LocalProcessSpawner()
    spawner._spawn_pending = True
    future = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda f: setattr(spawner, "_spawn_pending", False))
    spawner._spawn_future = future
    future.set_exception(RuntimeError("GPU quota exceeded"))
    assert spawner.active  # the callback has not run yet

    deleted = []
    orm_spawner = SimpleNamespace(server=None)
    user = SimpleNamespace(
        name="admin", orm_spawners={"big": orm_spawner}, spawners={"big": spawner}
    )
    db = SimpleNamespace(delete=deleted.append, commit=lambda: None)
    handler = SimpleNamespace(db=db, log=SimpleNamespace(info=lambda *a: None))
    assert not forget_unstarted_server(handler, user, "big")  # what the handlers did before
    assert await forget_refused_start(handler, user, "big")
    assert deleted == [orm_spawner] and "big" not in user.spawners


def test_a_first_start_refused_after_a_202_leaves_no_record_without_another_request(make_hub):
    # the refusal comes after JupyterHub answered (slow_spawn_timeout 0, as a start slower than
    # it, a busy hub's): no later request of hers may be needed for the record to go
    import sqlite3

    from tests.harness.wait import wait_for

    overlay = merged(TWO_A100)
    overlay.JupyterHub.tornado_settings.update({"slow_spawn_timeout": 0})
    hub = make_hub(overlay)
    hub.create_user("bob")
    r = hub.spawn("bob", "big", profile="gpu-2")
    assert r.status_code == 202, r.text

    def admin_page_lists_big() -> bool:
        # what /hub/admin shows: every user with her servers, stopped ones included
        r = hub.api("GET", "/users", params={"include_stopped_servers": "1"})
        return any("big" in user["servers"] for user in r.json())

    wait_for("the refused server's record to go", lambda: "big" not in _servers(hub, "bob"))
    assert not admin_page_lists_big()
    with sqlite3.connect(hub.state_dir / "jupyterhub.sqlite") as db:
        assert db.execute("SELECT count(*) FROM spawners WHERE name = 'big'").fetchone() == (0,)
    assert hub.allocations() == {}
    # her pending page still says why, and makes no record
    admin = hub.login("admin", hub.admin_password())
    page = admin.get("/hub/spawn-pending/bob/big")
    assert page.status_code == 403
    assert "GPU quota exceeded: User &#39;bob&#39; asks for 2 GPUs" in page.text
    assert "big" not in _servers(hub, "bob")

    # her pending page's event stream, opened as late, ends with the refusal (JupyterHub's own
    # answers 404, and the page's script then says "starting" for ever)
    r = hub.api("GET", "/users/bob/servers/big/progress")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    event = json.loads(r.text.split("data: ", 1)[1])
    assert event["failed"] and event["progress"] == 100
    assert event["message"].startswith("Spawn failed: GPU quota exceeded: User 'bob' asks for 2")
    # another tenant's token gets the 404 of a server that never was, and nothing of the reason
    hub.create_user("carol")
    r = hub.api("POST", "/users/carol/tokens", json={"note": "carol's own"})
    assert r.status_code == 201, r.text
    carol = {"Authorization": f"token {r.json()['token']}"}
    r = httpx.get(f"{hub.url}/hub/api/users/bob/servers/big/progress", headers=carol)
    assert r.status_code == 404 and "quota" not in r.text.lower()
    r = httpx.get(f"{hub.url}/hub/api/users/carol/servers/big/progress", headers=carol)
    assert r.status_code == 404  # her own server of that name: none, and no refusal of bob's
    assert "big" not in _servers(hub, "bob")
