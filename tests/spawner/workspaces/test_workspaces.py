"""Per-server workspaces on the local backend, through a real hub: each server has its own home,
a snapshot can be cloned into a new named server (kernel variables included), and the picker
offers the kernel checkpoint and the snapshots before a start."""

from __future__ import annotations

import asyncio
import html
import os
import re
import signal
import sqlite3
import time

from traitlets.config import Config

from tests.harness.hub import run_in_kernel


def _token_for(hub, user: str) -> str:
    return hub.api("POST", f"/users/{user}/tokens", json={"note": "test"}).json()["token"]


async def test_a_snapshot_clones_into_a_new_named_server_with_its_kernel_variables(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.create_user("eve")
    hub.start_server("alice")
    hub.start_server("alice", "scratch")
    env_default, env_scratch = hub.server_env("alice"), hub.server_env("alice", "scratch")
    assert env_default["HOME"] == str(hub.home("alice"))
    assert env_scratch["HOME"] == str(hub.home("alice", "scratch"))
    hub.stop_server("alice", "scratch")

    (hub.home("alice") / "model.txt").write_text("epoch 7\n")
    out = await run_in_kernel(hub, "alice", "best = {'epoch': 7, 'acc': 0.91}\nprint(best)")
    assert "0.91" in out
    hub.stop_server("alice")
    assert not (hub.home("alice", "scratch") / "model.txt").exists()  # homes are separate

    snapshots = hub.api("GET", "/gpulab/users/alice/snapshots").json()
    assert [k["variables"] for k in snapshots["kernels"]] == [1]
    newest = snapshots["snapshots"][0]["id"]
    clone_url = f"/gpulab/users/alice/snapshots/{newest}/clone"

    r = hub.api("POST", clone_url, json={"name": "exp-2"})
    assert r.status_code == 201, r.text
    assert r.json()["server"] == "exp-2" and r.json()["url"].endswith("/spawn/alice/exp-2")
    assert (hub.home("alice", "exp-2") / "model.txt").read_text() == "epoch 7\n"
    # the clone is a server of alice's, stopped, ready to start
    model = hub.api("GET", "/users/alice?include_stopped_servers=1").json()
    assert "exp-2" in model["servers"] and not model["servers"]["exp-2"]["ready"]

    # refused clones leave nothing behind
    assert hub.api("POST", clone_url, json={"name": "exp-2"}).status_code == 409
    r = hub.api("POST", clone_url, json={"name": "Bad Name!"})
    assert r.status_code == 400 and "Invalid server name" in r.json()["message"]
    r = hub.api("POST", "/gpulab/users/alice/snapshots/nope/clone", json={"name": "exp-3"})
    assert r.status_code == 404
    eve = {"Authorization": f"token {_token_for(hub, 'eve')}"}
    assert hub.client.post(clone_url, json={"name": "mine"}, headers=eve).status_code == 403
    model = hub.api("GET", "/users/alice?include_stopped_servers=1").json()
    assert set(model["servers"]) == {"", "scratch", "exp-2"}

    # the clone's kernels get the variables back (restore_kernels: no %gpulab_restore needed)
    r = hub.spawn("alice", "exp-2", restore_kernels=True)
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("alice", "exp-2")
    assert hub.server_env("alice", "exp-2")["GPULAB_AUTO_RESTORE"] == "1"
    out = await run_in_kernel(hub, "alice", "print('best is', best)", server="exp-2")
    assert "best is {'epoch': 7, 'acc': 0.91}" in out
    hub.stop_server("alice", "exp-2")
    # the choice held for one start only: JupyterHub reuses the last options otherwise
    hub.start_server("alice", "exp-2")
    assert "GPULAB_AUTO_RESTORE" not in hub.server_env("alice", "exp-2")
    hub.stop_server("alice", "exp-2")


def test_the_picker_offers_kernel_variables_and_snapshots_and_the_choice_is_applied(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.start_server("alice")
    (hub.home("alice") / "notes.txt").write_text("good\n")
    hub.stop_server("alice")
    hub.start_server("alice")
    (hub.home("alice") / "notes.txt").write_text("broken\n")
    hub.stop_server("alice")
    good = hub.api("GET", "/gpulab/users/alice/snapshots").json()["snapshots"][1]

    admin = hub.login("admin", hub.admin_password())
    form = admin.get("/hub/spawn/alice").text
    assert 'name="restore_snapshot"' in form and f'value="{good["id"]}"' in form
    assert "All snapshots: restore or clone" in form
    xsrf = re.search(r'name="_xsrf" value="([^"]+)"', form) or re.search(
        r'xsrf_token: "([^"]+)"', form
    )
    assert xsrf
    r = admin.post(
        "/hub/spawn/alice",
        data={"profile": "cpu", "restore_snapshot": good["id"], "_xsrf": xsrf.group(1)},
    )
    assert r.status_code == 200, r.text[-2000:]
    hub.wait_ready("alice")
    assert (hub.home("alice") / "notes.txt").read_text() == "good\n"
    hub.stop_server("alice")
    # the one-shot restore is forgotten: a REST start without options does not restore again
    (hub.home("alice") / "notes.txt").write_text("newer work\n")
    hub.start_server("alice")
    assert (hub.home("alice") / "notes.txt").read_text() == "newer work\n"
    hub.stop_server("alice")

    r = hub.spawn("alice", restore_snapshot="no-such-snapshot")
    assert r.status_code == 400 and "No snapshot 'no-such-snapshot'" in r.json()["message"]
    r = hub.spawn("alice", restore_kernels="yes")
    assert r.status_code == 400 and "'restore_kernels' must be true or false" in r.json()["message"]
    assert hub.server_model("alice") is None
    assert hub.allocations() == {}  # nothing allocated by the refused starts


def test_running_servers_are_snapshotted_on_a_schedule_and_on_demand(make_hub):
    # a snapshot a second, and room to keep them all: this is about the schedule, not retention
    hub = make_hub(
        Config(GPUSimpleLocalSpawner={"snapshot_interval_seconds": 1, "snapshot_keep_last": 1000})
    )
    hub.create_user("alice")
    assert hub.api("POST", "/gpulab/users/alice/snapshots").status_code == 409  # no home yet
    hub.start_server("alice")
    (hub.home("alice") / "running.txt").write_text("while it runs\n")
    deadline = time.monotonic() + 60
    labels: list[str] = []
    while "scheduled" not in labels and time.monotonic() < deadline:
        time.sleep(0.5)
        labels = [
            s["label"] for s in hub.api("GET", "/gpulab/users/alice/snapshots").json()["snapshots"]
        ]
    assert "scheduled" in labels
    r = hub.api("POST", "/gpulab/users/alice/snapshots")
    assert r.status_code == 201 and r.json()["label"] == "on-demand" and r.json()["files"] >= 1
    hub.stop_server("alice")
    labels = [
        s["label"] for s in hub.api("GET", "/gpulab/users/alice/snapshots").json()["snapshots"]
    ]
    assert labels[0] == "on-stop" and "on-demand" in labels


def test_the_workspaces_page_restores_and_clones(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.start_server("alice")
    (hub.home("alice") / "data.csv").write_text("a,b\n1,2\n")
    hub.stop_server("alice")
    snap = hub.api("GET", "/gpulab/users/alice/snapshots").json()["snapshots"][0]
    (hub.home("alice") / "data.csv").unlink()

    admin = hub.login("admin", hub.admin_password())
    page = admin.get("/hub/gpulab/workspaces", params={"user": "alice"})
    assert page.status_code == 200 and f'data-snapshot="{snap["id"]}"' in page.text
    xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page.text).group(1)
    form = {"_xsrf": xsrf, "server": "", "snapshot": snap["id"]}
    r = admin.post("/hub/gpulab/workspaces?user=alice", data={**form, "action": "restore"})
    assert r.status_code == 200 and "Restored default server" in r.text
    assert (hub.home("alice") / "data.csv").read_text() == "a,b\n1,2\n"

    r = admin.post(
        "/hub/gpulab/workspaces?user=alice", data={**form, "action": "clone", "name": "copy"}
    )
    assert r.status_code == 200 and "into new server 'copy'" in html.unescape(r.text)
    assert (hub.home("alice", "copy") / "data.csv").exists()
    r = admin.post(
        "/hub/gpulab/workspaces?user=alice", data={**form, "action": "clone", "name": "copy"}
    )
    assert r.status_code == 409 and "already has a server named 'copy'" in html.unescape(r.text)

    r = admin.post("/hub/gpulab/workspaces?user=alice", data={**form, "action": "snapshot"})
    assert r.status_code == 200 and "Took a snapshot of default server" in r.text
    assert "on-demand" in r.text


async def test_a_server_that_died_gets_its_kernel_variables_back_without_asking(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.start_server("alice")
    await run_in_kernel(hub, "alice", "state = list(range(5))")
    os.kill(hub.server_pid("alice"), signal.SIGKILL)  # lost, not stopped
    deadline = time.monotonic() + 60
    while hub.server_model("alice") is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert hub.server_model("alice") is None, "the hub did not notice the dead server"

    hub.start_server("alice")
    assert hub.server_env("alice")["GPULAB_AUTO_RESTORE"] == "1"
    out = await run_in_kernel(hub, "alice", "print('state', state)")
    assert "state [0, 1, 2, 3, 4]" in out
    hub.stop_server("alice")
    hub.start_server("alice")  # a normal stop: the next start offers, it does not restore alone
    assert "GPULAB_AUTO_RESTORE" not in hub.server_env("alice")
    hub.stop_server("alice")


def _add_legacy_named_server(hub, user: str, name: str) -> None:
    """A named server record as a hub before the name was reserved could have made it (the hub
    is stopped meanwhile; its database is plain SQLite)."""
    hub.stop_hub()
    with sqlite3.connect(hub.state_dir / "jupyterhub.sqlite") as db:
        db.execute(
            "INSERT INTO spawners (user_id, name, state, user_options) "
            "VALUES ((SELECT id FROM users WHERE name = ?), ?, '{}', '{}')",
            (user, name),
        )
    hub.start()


def test_restore_and_clone_refuse_while_any_server_using_that_home_runs(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.start_server("alice")
    (hub.home("alice") / "notes.txt").write_text("snapshotted\n")
    hub.stop_server("alice")
    # a named server 'default' left from before: it shares the default server's home
    _add_legacy_named_server(hub, "alice", "default")
    hub.start_server("alice")
    (hub.home("alice") / "notes.txt").write_text("work in progress\n")
    legacy = "/gpulab/users/alice/servers/default/snapshots"
    (snap,) = [s for s in hub.api("GET", legacy).json()["snapshots"] if s["label"] == "on-stop"]
    before = [s["id"] for s in hub.api("GET", legacy).json()["snapshots"]]

    message = (
        "Cannot {} home 'default' of alice while the default server uses it: stop that server first"
    )
    r = hub.api("POST", f"{legacy}/{snap['id']}/restore")
    assert r.status_code == 409 and r.json()["message"] == message.format("restore")
    r = hub.api("POST", f"{legacy}/{snap['id']}/clone", json={"name": "copy"})
    assert r.status_code == 409 and r.json()["message"] == message.format("clone")
    r = hub.api("POST", f"/gpulab/users/alice/snapshots/{snap['id']}/restore")
    assert r.status_code == 409 and r.json()["message"] == message.format("restore")
    # nothing changed: the running server's home, the snapshots, the servers
    assert (hub.home("alice") / "notes.txt").read_text() == "work in progress\n"
    assert [s["id"] for s in hub.api("GET", legacy).json()["snapshots"]] == before
    model = hub.api("GET", "/users/alice", params={"include_stopped_servers": "1"}).json()
    assert set(model["servers"]) == {"", "default"}
    assert not hub.home("alice", "copy").exists()

    admin = hub.login("admin", hub.admin_password())
    page = admin.get("/hub/gpulab/workspaces", params={"user": "alice"}).text
    section = page[page.index('data-server="default"') :]
    assert 'disabled title="Stop the default server first: it uses this home"' in section

    hub.stop_server("alice")
    r = hub.api("POST", f"{legacy}/{snap['id']}/restore")
    assert r.status_code == 200, r.text
    assert (hub.home("alice") / "notes.txt").read_text() == "snapshotted\n"
