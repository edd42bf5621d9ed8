"""Workspace snapshots through the hub's REST API: one per stop, restore a stopped server's home."""

from __future__ import annotations


def test_each_stop_snapshots_the_home_and_a_snapshot_can_be_restored(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.create_user("eve")
    home = hub.home("alice")
    snapshots_url = "/gpulab/users/alice/snapshots"

    hub.start_server("alice")
    (home / "notes.txt").write_text("first draft\n")
    hub.stop_server("alice")
    hub.start_server("alice")
    (home / "notes.txt").write_text("ruined\n")
    hub.stop_server("alice")

    listing = hub.api("GET", snapshots_url)
    assert listing.status_code == 200, listing.text
    newest, older = listing.json()["snapshots"][:2]
    assert newest["label"] == older["label"] == "on-stop"

    hub.start_server("alice")
    r = hub.api("POST", f"{snapshots_url}/{older['id']}/restore")
    assert r.status_code == 409 and "while the default server uses it" in r.json()["message"]
    hub.stop_server("alice")

    r = hub.api("POST", f"{snapshots_url}/{older['id']}/restore")
    assert r.status_code == 200, r.text
    assert r.json()["restored"] == older["id"] and r.json()["before_restore"]
    assert (home / "notes.txt").read_text() == "first draft\n"
    assert hub.api("POST", f"{snapshots_url}/no-such-id/restore").status_code == 404

    # another user's token cannot list alice's snapshots
    token = hub.api("POST", "/users/eve/tokens", json={"note": "test"}).json()["token"]
    r = hub.client.get(snapshots_url, headers={"Authorization": f"token {token}"})
    assert (
        r.status_code == 403
        and "lack the scope 'read:servers' on user 'alice'" in r.json()["message"]
    )
