"""One OS account per user on the embedded default, tried from inside real kernels: a user's code
cannot read another user's files, checkpoints, key or processes, nor the hub's state, and the hub
never acts as root on a path the user controls."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from traitlets.config import Config

from tests.harness.hub import run_in_kernel
from tests.harness.isolation import KERNEL_PROBE

if os.geteuid() != 0:  # pragma: no cover - CI and the dev machines run as root
    pytest.skip("per-user accounts need a hub running as root", allow_module_level=True)


def _probe(targets: dict[str, str], homes: str, state: str, pids: dict[str, int]) -> str:
    """Code for a kernel: each read, listing and signal, reported as allowed/denied/missing."""
    listings = {"list homes": homes, "list state": state}
    return f"READS = {targets!r}\nLISTINGS = {listings!r}\nPIDS = {pids!r}\n" + KERNEL_PROBE


def _useradd(name: str, *options: str) -> None:
    """A system account as an admin would make it (uid in the test hubs' range, so that the hub's
    cleanup removes it with the others)."""
    range_ = ["-K", "UID_MIN=200000", "-K", "UID_MAX=299999"]
    subprocess.run(["useradd", *range_, *options, name], check=True)


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


async def test_each_user_runs_as_an_unprivileged_account_of_their_own(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice")
    hub.start_server("bob")
    alice, bob = hub.account("alice"), hub.account("bob")
    assert alice.pw_uid != bob.pw_uid
    for account in (alice, bob):
        assert 200000 <= account.pw_uid <= 299999 and account.pw_gid != 0
    assert _uid_of(hub.server_pid("alice")) == alice.pw_uid
    assert _uid_of(hub.server_pid("bob")) == bob.pw_uid
    out = await run_in_kernel(
        hub, "alice", "import os; print(os.getuid(), os.getgid(), os.getgroups())"
    )
    assert out.split()[:2] == [str(alice.pw_uid), str(alice.pw_gid)]
    assert "0" not in out.split()[2:]  # no supplementary group of the hub's
    home = hub.home("alice")
    st = home.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice.pw_uid, 0o700)
    assert home.parent.stat().st_uid == alice.pw_uid  # all of alice's server homes are hers
    assert "--allow-root" not in Path(f"/proc/{hub.server_pid('alice')}/cmdline").read_text()


async def test_a_kernel_cannot_reach_another_users_files_key_processes_or_the_hubs_state(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice")
    hub.start_server("bob")
    # bob leaves a file and a kernel checkpoint behind, as his own account
    await run_in_kernel(hub, "bob", "open('notes.txt', 'w').write('bob private')\nsecret = 42")
    hub.stop_server("bob")
    hub.start_server("bob")
    bob_home = hub.home("bob")
    bob_key = hub.server_env("bob")["GPULAB_CHECKPOINT_KEY_FILE"]
    state = hub.state_dir
    targets = {
        "bob's file": str(bob_home / "notes.txt"),
        "bob's checkpoints": str(bob_home / ".gpulab" / "checkpoints" / "default"),
        "bob's key": bob_key,
        "hub database": str(state / "jupyterhub.sqlite"),
        "cookie secret": str(state / "jupyterhub_cookie_secret"),
        "checkpoint secret": str(state / "gpulab-checkpoint-secret"),
        "allocations": str(state / "gpulab-allocations.sqlite"),
        "admin password": str(state / "initial-admin-password"),
        "bob's snapshots": str(state / "snapshots" / "bob" / "default"),
    }
    for name, path in targets.items():
        assert Path(path).exists(), f"{name}: {path} should exist for the probe to mean anything"
    pids = {"bob's server": hub.server_pid("bob"), "hub": hub.proc.pid}
    out = await run_in_kernel(hub, "alice", _probe(targets, str(state / "homes"), str(state), pids))
    results = json.loads(out.splitlines()[-1])  # after the kernel's restore offer, if any
    assert results == {name: "denied" for name in results}, results
    # and the same probe as bob on his own things is allowed: the denials are about ownership
    own = {"bob's file": targets["bob's file"], "bob's key": bob_key}
    out = await run_in_kernel(hub, "bob", _probe(own, str(bob_home), str(bob_home), {}))
    assert json.loads(out.splitlines()[-1]) == {
        "bob's file": "allowed",
        "bob's key": "allowed",
        "list homes": "allowed",
        "list state": "allowed",
    }


async def test_the_checkpoint_key_is_a_file_of_the_users_account_not_an_environment_variable(
    make_hub,
):
    hub = make_hub()
    hub.create_user("alice")
    hub.start_server("alice")
    env = hub.server_env("alice")
    assert "GPULAB_CHECKPOINT_KEY" not in env
    key_file = env["GPULAB_CHECKPOINT_KEY_FILE"]
    st = os.stat(key_file)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (hub.account("alice").pw_uid, 0o400)
    # no process of alice's server carries a 64-hex key in its environment
    key = Path(key_file).read_text().strip()
    assert len(key) == 64
    out = await run_in_kernel(
        hub,
        "alice",
        "import os\nprint(any(v == open(os.environ['GPULAB_CHECKPOINT_KEY_FILE']).read().strip()"
        " for v in os.environ.values()))",
    )
    assert out.strip() == "False"


def test_with_workspaces_off_servers_still_run_as_the_users_account(make_hub):
    hub = make_hub(Config(GPUSimpleLocalSpawner={"checkpoints": False}))
    hub.create_user("alice")
    hub.start_server("alice")
    alice = hub.account("alice")
    assert _uid_of(hub.server_pid("alice")) == alice.pw_uid
    assert hub.home("alice").stat().st_uid == alice.pw_uid
    assert "GPULAB_CHECKPOINT_KEY_FILE" not in hub.server_env("alice")


def test_the_state_directory_is_passable_only_and_the_hubs_files_private(make_hub):
    hub = make_hub()
    state = hub.state_dir
    assert stat.S_IMODE(state.stat().st_mode) == 0o711
    for name in (
        "jupyterhub.sqlite",
        "jupyterhub_cookie_secret",
        "gpulab-allocations.sqlite",
        "initial-admin-password",
    ):
        st = (state / name).stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), name


async def test_a_symlink_planted_in_a_home_never_makes_the_hub_copy_what_it_points_at(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    hub.start_server("alice")
    cookie = hub.state_dir / "jupyterhub_cookie_secret"
    # alice links the hub's cookie secret (and the hub's state directory) into her home, then
    # snapshots, restores and clones: had root done the copying, the secret would now be hers
    await run_in_kernel(
        hub,
        "alice",
        f"import os\nos.symlink({str(cookie)!r}, 'cookie')\nos.symlink({str(hub.state_dir)!r}, 'state')",
    )
    hub.stop_server("alice")
    snaps = hub.api("GET", "/gpulab/users/alice/snapshots").json()["snapshots"]
    newest = snaps[0]["id"]
    r = hub.api("POST", f"/gpulab/users/alice/snapshots/{newest}/restore")
    assert r.status_code == 200, r.text
    r = hub.api("POST", f"/gpulab/users/alice/snapshots/{newest}/clone", json={"name": "copy"})
    assert r.status_code == 201, r.text
    for home in (hub.home("alice"), hub.home("alice", "copy")):
        assert (home / "cookie").is_symlink() and (home / "state").is_symlink()
    snapshot_trees = list((hub.state_dir / "snapshots" / "alice").rglob("cookie"))
    assert snapshot_trees and all(p.is_symlink() for p in snapshot_trees)
    hub.start_server("alice", "copy")
    out = await run_in_kernel(
        hub,
        "alice",
        "try:\n    open('cookie','rb').read()\n    print('read')\nexcept PermissionError:\n    print('denied')",
        server="copy",
    )
    assert out.splitlines()[-1] == "denied"


def test_an_existing_account_not_made_for_the_user_is_refused(make_hub):
    hub = make_hub()
    hub.create_user("carol")
    squatter = hub.account_prefix + "carol"
    _useradd(squatter, "--no-create-home")  # removed with the hub's accounts at cleanup
    r = hub.spawn("carol")
    assert r.status_code == 409, r.text
    assert squatter in r.json()["message"] and "system_account_prefix" in r.json()["message"]
    assert hub.server_model("carol") is None or not hub.server_model("carol").get("ready")
    assert hub.allocations() == {}


def test_servers_as_the_hubs_root_account_need_an_explicit_single_person_opt_in(make_hub):
    hub = make_hub(Config(GPUSimpleLocalSpawner={"server_accounts": "hub"}))
    hub.create_user("alice")
    r = hub.spawn("alice")
    assert r.status_code == 403, r.text
    assert "allow_root_servers" in r.json()["message"]
    assert hub.allocations() == {}


def test_a_single_person_install_says_so_on_every_page_and_admits_one_user(make_hub):
    hub = make_hub(
        Config(GPUSimpleLocalSpawner={"server_accounts": "hub", "allow_root_servers": True})
    )
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice")
    assert _uid_of(hub.server_pid("alice")) == 0
    assert hub.accounts() == []
    page = hub.login("admin", hub.admin_password()).get("/hub/home").text
    assert "Single-person install: every server runs as root" in page
    r = hub.spawn("bob")
    assert r.status_code == 403, r.text
    assert "shared_account_max_users" in r.json()["message"]


async def test_existing_system_users_keep_their_accounts_with_workspaces_on(make_hub):
    # GPULocalSpawner: the hub user is an existing system account of the same name (an admin made
    # it); its workspace is that account's home, checkpoints are on and signed with its key file
    hub = make_hub(Config(JupyterHub={"spawner_class": "gpulab-local"}))
    name = hub.account_prefix + "dave"
    home = hub.state_dir / "system-homes" / name
    home.parent.mkdir(mode=0o711)
    _useradd(name, "--home-dir", str(home), "--create-home")
    hub.create_user(name)
    hub.start_server(name)
    dave = hub.account("dave")
    assert _uid_of(hub.server_pid(name)) == dave.pw_uid
    env = hub.server_env(name)
    assert env["HOME"] == str(home)
    assert os.stat(env["GPULAB_CHECKPOINT_KEY_FILE"]).st_uid == dave.pw_uid
    await run_in_kernel(hub, name, "weights = [0.5, 0.25]")
    hub.stop_server(name)
    snaps = hub.api("GET", f"/gpulab/users/{name}/snapshots").json()
    assert snaps["snapshots"] and [k["variables"] for k in snaps["kernels"]] == [1]
    store = hub.state_dir / "snapshots" / name
    assert store.stat().st_uid == dave.pw_uid


def test_a_hub_that_is_not_root_says_users_share_its_account_and_admits_one_user(make_hub):
    hub = make_hub(start=False)
    service = hub.account_prefix + "hubsvc"  # removed with the hub's accounts at cleanup
    _useradd(service, "--no-create-home")
    uid, gid = hub.account("hubsvc").pw_uid, hub.account("hubsvc").pw_gid
    os.chown(hub.state_dir, uid, gid)
    hub.run_as = service
    hub.start()
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice")
    assert _uid_of(hub.server_pid("alice")) == uid  # the hub's own account: no switch possible
    page = hub.login("admin", hub.admin_password()).get("/hub/home").text
    assert f"All users' servers run as one OS account ({service})" in page
    assert "gpulab: WARNING: All users' servers run as one OS account" in hub.log()
    r = hub.spawn("bob")
    assert r.status_code == 403, r.text
    assert "shared_account_max_users" in r.json()["message"]
    hub.stop_server("alice")
    hub.start_server("bob")  # one user at a time, not one user ever
