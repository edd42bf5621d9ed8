"""`gpulab stop`: stop the embedded hub with everything it started.

A hub stopped by a signal leaves its users' servers (and their kernels, code-server, Dask
clusters and jobs) running, on purpose (`JupyterHub.cleanup_servers = False`): a restart, an
upgrade or a config change must not end people's work. `gpulab stop` is for when everything
should go:

1. It asks the hub to shut down with its servers and proxy (JupyterHub's `POST /api/shutdown`,
   `servers` and `proxy` true), as the service `gpulab-stop`, whose role holds the `shutdown`
   scope alone. Each server is then stopped by its spawner, which releases its GPUs once and
   snapshots its home as any stop does.
2. It waits for the hub's process to end (its pid file, `jupyterhub.pid` in the state directory).
3. It ends the processes the hub started as its own account that outlive it (warm pool members
   waiting for a claim run in sessions of their own), and what is left of the hub's users'
   processes: every process of an account that owns a
   user's directory in the state directory (`homes/`, `snapshots/`, `job-runs/`: the hub hands
   each to the user's own account), which takes in the servers' process trees, kernels,
   code-server, Dask schedulers and workers and job runs, whatever session they are in (SIGTERM,
   then SIGKILL after a grace). Nothing is released by this step: the next hub start finds those
   servers and runs gone and reconciles their records, as after a crash.

Why no tenant can use it: the token is written where only the hub's account can read it (the
state directory's files are 0600, see `gpulab.hub.state_dir`) and is worth the `shutdown` scope
alone; `gpulab stop` itself needs that account (root, on the embedded default) to read it and to
signal other accounts' processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpulab.hub.state_dir import USER_FACING_DIRS

#: the service `gpulab stop` calls the hub as, and its role
SERVICE_NAME = "gpulab-stop"
#: in the state directory: where the hub's API is and the service's token (0600)
STOP_FILE = "gpulab-stop.json"
#: in the state directory: the hub's pid (JupyterHub.pid_file)
PID_FILE = "jupyterhub.pid"
#: in the state directory: configurable-http-proxy's pid (JupyterHub writes it)
PROXY_PID_FILE = "jupyterhub-proxy.pid"
#: how long stopped processes get between SIGTERM and SIGKILL
GRACE_SECONDS = 10.0


def add_stop_service(c: Any, state_dir: str | os.PathLike[str]) -> None:
    """The shipped config's part: the pid file, the `gpulab-stop` service with a fresh token and
    a role of the `shutdown` scope alone, and the file that tells `gpulab stop` both. Call it
    after the hub's address is final (an admin's config may change it)."""
    state = Path(state_dir)
    c.JupyterHub.pid_file = str(state / PID_FILE)
    token = secrets.token_hex(32)
    base_url = str(c.JupyterHub.get("base_url", "/")).rstrip("/")
    ip = str(c.JupyterHub.get("hub_ip") or "127.0.0.1")
    ip = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(ip, f"[{ip}]" if ":" in ip else ip)
    api_url = f"http://{ip}:{c.JupyterHub.get('hub_port', 8081)}{base_url}/hub/api"
    path = state / STOP_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        json.dump({"api_url": api_url, "token": token}, f)
    c.JupyterHub.services.append({"name": SERVICE_NAME, "api_token": token, "display": False})
    c.JupyterHub.load_roles.append(
        {"name": SERVICE_NAME, "scopes": ["shutdown"], "services": [SERVICE_NAME]}
    )


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it holds nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _uid_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def hub_pid(state: Path) -> int | None:
    """The running hub's pid from its pid file, or None when none runs from `state`."""
    try:
        pid = int((state / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def user_uids(state: Path) -> set[int]:
    """The accounts of this hub's users: the owners of their directories in the state directory
    (never the hub's own account, which owns the directories of a shared-account install)."""
    me = os.geteuid()
    uids = set()
    for name in USER_FACING_DIRS:
        folder = state / name
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            st = entry.lstat()
            if st.st_uid not in (me, 0):
                uids.add(st.st_uid)
    return uids


def processes_of(uids: set[int]) -> list[int]:
    """The live processes running as one of `uids`."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [pid for pid in pids if _uid_of(pid) in uids and _alive(pid)]


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat: with the pid, one process for good (pids are reused)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_line.rsplit(")", 1)[1].split()[19]


def children_of(pid: int) -> dict[int, str]:
    """The live children of `pid`, each with its start time."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            started = _start_time(child)
            if started is not None:
                out[child] = started
    return out


def end_processes(find: Callable[[], list[int]], grace_seconds: float = GRACE_SECONDS) -> int:
    """SIGTERM to every process `find` lists, SIGKILL to what is left after the grace (and to
    what they fork meanwhile); returns how many there were at first."""
    first = find()
    signum = signal.SIGTERM
    deadline = time.monotonic() + grace_seconds
    while pids := find():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if time.monotonic() > deadline:
            signum = signal.SIGKILL
        if time.monotonic() > deadline + grace_seconds:
            raise RuntimeError(f"processes {pids[:10]} survived SIGKILL")
        time.sleep(0.2)
    return len(first)


def _ask_hub_to_shut_down(state: Path) -> str | None:
    """POST /api/shutdown with servers and proxy; None when the hub took it, else why not."""
    try:
        info = json.loads((state / STOP_FILE).read_text())
        request = urllib.request.Request(
            f"{info['api_url']}/shutdown",
            data=json.dumps({"servers": True, "proxy": True}).encode(),
            headers={"Authorization": f"token {info['token']}"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30):
            return None
    except (OSError, ValueError, KeyError) as e:
        return str(e)


def _stop_orphan_proxy(state: Path, say: Any) -> None:
    """The proxy a hub that was killed left behind (a hub that shut down stopped its own)."""
    try:
        pid = int((state / PROXY_PID_FILE).read_text().strip())
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if b"configurable-http-proxy" in command and _alive(pid):
        say(f"gpulab: stopping the hub's proxy (pid {pid})")
        os.kill(pid, signal.SIGTERM)


def stop(state: Path, timeout_seconds: float, say: Any = print) -> int:
    """Stop the hub running from `state` and everything it started (see the module doc)."""
    pid = hub_pid(state)
    # what the hub runs in sessions of its own as its own account (warm pool members waiting
    # for a claim) outlives it: taken down below unless the hub's shutdown ended them
    started_by_hub = children_of(pid) if pid is not None else {}
    if pid is None:
        say(f"gpulab: no hub runs from {state}; ending what its users left running")
    else:
        refused = _ask_hub_to_shut_down(state)
        if refused is not None:
            say(f"gpulab: the hub did not take the shutdown request ({refused}); sending SIGTERM")
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_seconds
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            say(f"gpulab: the hub (pid {pid}) did not stop in {timeout_seconds:g} s; SIGKILL")
            os.kill(pid, signal.SIGKILL)
        say(f"gpulab: the hub (pid {pid}) has stopped")
    _stop_orphan_proxy(state, say)

    def hubs_children_left() -> list[int]:
        return [p for p, t in started_by_hub.items() if _start_time(p) == t and _alive(p)]

    left = end_processes(hubs_children_left)
    uids = user_uids(state)
    left += end_processes(lambda: processes_of(uids))
    say(f"gpulab: {left} process(es) the hub left running have been ended")
    return 0
