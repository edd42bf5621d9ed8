"""What a test run that was killed left on the machine, found and removed by the next run.

A test's teardown stops what it started: a hub's servers, kernels and Dask clusters, the hub
and its proxy, the accounts it made (`Hub.close`, `Hub.cleanup`, `TestAccounts.close`). A run
that never gets to its teardowns (SIGKILL, a second Ctrl-C, an xdist worker that died, a CI
job stopped) leaves all of that running as the test accounts and root, holding ports and memory
for good. So every directory under PASSABLE_ROOT that a hub or a TestAccounts makes names its
owner, the pytest process (pid and start time, since pids are reused), and a variable the hub's
processes carry (its config file's path, which is the directory's own); `sweep()`, run when a
test session starts, removes the directories whose owner is gone: it kills the processes that
carry the variable (the hub, its proxy, which runs in a session of its own, its services) and
everything running as the directory's accounts, and removes the accounts and the directory.

Why it cannot take another run's things: a directory is swept only when the process that wrote
its owner file no longer exists (a run beside this one, the dev-cluster half of CI or a
developer's, is alive); processes are matched by a path inside the directory, which no other
hub names, and accounts by the directory's own random prefix. A directory without an owner file (one being made, or one
made before this module) is left as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
from pathlib import Path

OWNER_FILE = "test-owner.json"


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces
    return int(stat.rsplit(")", 1)[1].split()[19])


def claim(folder: Path, *, account_prefix: str, marker: str = "") -> None:
    """Name this process as the owner of `folder` (its accounts start with `account_prefix`;
    `marker`: a NAME=value its hub's processes carry in their environment)."""
    owner = {
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "account_prefix": account_prefix,
        "marker": marker,
    }
    (folder / OWNER_FILE).write_text(json.dumps(owner))


def _owner_alive(owner: dict[str, object]) -> bool:
    pid = owner.get("pid")
    started = _start_time(pid) if isinstance(pid, int) else None
    return started is not None and started == owner.get("start")


def _carrying(marker: str) -> list[int]:
    """The live processes that carry `marker` (NAME=value) in their environment."""
    want = f"\0{marker}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if want in b"\0" + (proc / "environ").read_bytes():
                    found.append(int(proc.name))
    return found


def sweep(root: Path) -> list[str]:
    """Remove what runs for, and is kept in, every directory under `root` whose owner is gone;
    the names of the directories removed."""
    from tests.harness.hub import remove_account  # the hub harness imports this module

    removed = []
    if not root.is_dir():
        return removed
    for folder in sorted(root.iterdir()):
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # being made, or not ours to judge
        if not isinstance(owner, dict) or _owner_alive(owner):
            continue
        marker = str(owner.get("marker") or "")
        if marker:
            for pid in _carrying(marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        prefix = str(owner.get("account_prefix") or "")
        if prefix:
            for entry in pwd.getpwall():
                if entry.pw_name.startswith(prefix):
                    remove_account(entry.pw_name, entry.pw_uid)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    return removed
