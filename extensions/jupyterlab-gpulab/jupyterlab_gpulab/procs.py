"""Which GPU processes belong to this server's user: /proc lookups for NVML's pids."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def process_name(pid: int) -> str:
    """The command name, or "" when the pid is not visible here (another container's process)."""
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def descends_from(pid: int, ancestor: int, max_depth: int = 64) -> bool:
    for _ in range(max_depth):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            pid = int(_status(pid)["PPid"])
        except (OSError, KeyError, ValueError):
            return False
    return False


def is_own(pid: int, uid: int | None = None, server_pid: int | None = None) -> bool:
    """A process of this server's user: same real uid, or a descendant of the server process.

    Root-run servers (containers) match descendants only, so another root-run container's
    processes, visible from the host's NVML, are never counted as the user's. NVML reports host
    pids; inside a pid namespace they may not exist here, and then nothing is claimed.
    """
    uid = os.getuid() if uid is None else uid
    server_pid = os.getpid() if server_pid is None else server_pid
    if uid != 0:
        try:
            if int(_status(pid)["Uid"].split()[0]) == uid:
                return True
        except (OSError, KeyError, ValueError, IndexError):
            return False
    return descends_from(pid, server_pid)
