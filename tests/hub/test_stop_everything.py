"""`gpulab stop`: the hub with everything it started, through a real hub. A signal to the hub
stops the hub alone and leaves servers running (tests/hub/test_shutdown.py); `gpulab stop`
leaves no process of the hub's users, no warm member and no proxy, and releases each GPU share
once."""

from __future__ import annotations

import asyncio
import collections
import re
import subprocess
import time
from typing import Any

import psutil
from traitlets.config import Config

from tests.harness.hub import BIN, merged, pids_of_uid, run_in_kernel
from tests.harness.jobs import INVENTORY, put, until, user_client

POOL = Config(GPUWarmPool={"pools": [{"profile": "gpu-quarter", "min": 1, "max": 1}]})


def _warm_members(hub: Any) -> list[int]:
    return [
        p.pid
        for p in psutil.Process(hub.proc.pid).children()
        if "gpulab.spawner.singleuser.warm_server" in p.cmdline()
    ]


def _wait_for(what: str, check: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.3)
    raise AssertionError(f"no {what} after {timeout} s")


async def test_gpulab_stop_ends_the_hub_and_every_process_it_started(make_hub):
    hub = make_hub(merged(INVENTORY, POOL))
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="cpu")
    # a kernel left running, as a user closing her browser would
    await run_in_kernel(hub, "alice", "x = 1", keep_kernel=True)
    hub.start_server("bob", "train", profile="gpu-half")  # the pool's member stays unclaimed
    # a job run of alice's, waiting in its own session
    put(hub, "alice", "wait.py", "import time\ntime.sleep(600)\n")
    alice = user_client(hub, "alice")
    r = alice.post(
        "/users/alice/jobs",
        json={"name": "long", "kind": "script", "path": "wait.py", "profile": "gpu-quarter"},
    )
    assert r.status_code == 201, r.text
    until(alice, f"/users/alice/jobs/{r.json()['id']}", "running")
    members = _wait_for("warm member", lambda: _warm_members(hub))
    uids = [hub.account(user).pw_uid for user in ("alice", "bob")]
    assert all(pids_of_uid(uid) for uid in uids)
    proxy = int((hub.state_dir / "jupyterhub-proxy.pid").read_text())

    result = await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "gpulab"), "stop", "--state-dir", str(hub.state_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout, result.stderr, hub.log()[-3000:])
    print(result.stdout)
    assert hub.wait_exit(30) == 0
    assert {uid: pids_of_uid(uid) for uid in uids} == {uid: [] for uid in uids}
    assert not [pid for pid in [*members, proxy] if psutil.pid_exists(pid) and _running(pid)]
    # each share the hub released, once (the job's is the next hub's to reconcile)
    released = collections.Counter(re.findall(r"Released GPU allocation (\S+)", hub.log()))
    assert released["bob/train"] == 1, released
    assert [a for a, n in released.items() if n > 1] == []


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
