"""The workspace contract's behaviour, one scenario run against each backend through a real hub
(`gpulab.hub.workspaces.Workspaces`): what the hub's REST API answers must not depend on where
homes live. Called by tests/spawner/workspaces/test_contract.py (local) and
tests/spawner/kube/test_workspaces.py (Kubernetes, on that module's dev cluster)."""

from __future__ import annotations

from typing import Any

from gpulab.hub.workspaces import SnapshotListing
from tests.harness.hub import Hub, run_in_kernel

#: keys every backend's snapshot listing has (a backend may add its own)
LISTING_KEYS = set(SnapshotListing.__annotations__)

WRITE = "import os; open(os.path.expanduser('~/data.csv'), 'w').write('a,b\\n1,2\\n')"
REMOVE = "import os; os.remove(os.path.expanduser('~/data.csv'))"
READ = "import os; p = os.path.expanduser('~/data.csv'); print('has', os.path.exists(p))"


def _is_listing(snap: dict[str, Any]) -> bool:
    return (
        set(snap) >= LISTING_KEYS
        and isinstance(snap["id"], str)
        and isinstance(snap["created"], int | float)
        and isinstance(snap["size"], str)
    )


def _snapshots(hub: Hub, user: str) -> dict[str, Any]:
    r = hub.api("GET", f"/gpulab/users/{user}/snapshots")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def check_workspace_contract(hub: Hub, user: str, profile: str | None = None) -> None:
    """Snapshot (on demand, on stop), list, restore, clone and the start's one-shot choices,
    with their refusals, as the REST API promises them for every backend."""
    base = f"/gpulab/users/{user}/snapshots"
    hub.create_user(user)
    hub.start_server(user, profile=profile)
    await run_in_kernel(hub, user, WRITE)
    r = hub.api("POST", base)  # on demand, while the server runs
    assert r.status_code == 201, r.text
    taken = r.json()
    assert _is_listing(taken) and taken["label"] == "on-demand", taken
    await run_in_kernel(hub, user, REMOVE)
    r = hub.api("POST", f"{base}/{taken['id']}/restore")
    assert r.status_code == 409 and "stop that server first" in r.json()["message"], r.text
    hub.stop_server(user)

    listed = _snapshots(hub, user)
    snaps, kernels = listed["snapshots"], listed["kernels"]
    assert [s["label"] for s in snaps[:2]] == ["on-stop", "on-demand"], snaps
    assert all(_is_listing(s) for s in snaps), snaps
    created = [s["created"] for s in snaps]
    assert created == sorted(created, reverse=True)  # newest first
    assert isinstance(kernels, list)

    # refusals leave nothing behind
    assert hub.api("POST", f"{base}/no-such-snapshot/restore").status_code == 404
    r = hub.api("POST", f"{base}/no-such-snapshot/clone", json={"name": "never"})
    assert r.status_code == 404, r.text
    assert "never" not in hub.api("GET", f"/users/{user}").json()["servers"]

    r = hub.api("POST", f"{base}/{taken['id']}/restore")
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"restored", "before_restore"}, r.json()
    assert r.json()["restored"] == taken["id"] and isinstance(r.json()["before_restore"], str)
    assert _snapshots(hub, user)["snapshots"][0]["label"] == "before-restore"
    hub.start_server(user, profile=profile)
    assert "has True" in await run_in_kernel(hub, user, READ)
    hub.stop_server(user)

    r = hub.api("POST", f"{base}/{taken['id']}/clone", json={"name": "exp"})
    assert r.status_code == 201, r.text
    assert {"cloned", "server", "url"} <= set(r.json()) and r.json()["server"] == "exp"
    assert hub.api("POST", f"{base}/{taken['id']}/clone", json={"name": "exp"}).status_code == 409
    hub.start_server(user, "exp", profile=profile)
    assert "has True" in await run_in_kernel(hub, user, READ, server="exp")
    hub.stop_server(user, "exp")

    # the start's one-shot choices, checked before anything is allocated
    r = hub.spawn(user, profile=profile, restore_snapshot="no-such-snapshot")
    assert r.status_code == 400 and "No snapshot 'no-such-snapshot'" in r.json()["message"]
    r = hub.spawn(user, profile=profile, restore_kernels="yes")
    assert r.status_code == 400 and "'restore_kernels' must be true or false" in r.text
