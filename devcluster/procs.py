"""Detached processes the dev cluster starts: launch, identify by PID + start time, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

_CHILDREN: dict[int, subprocess.Popen] = {}  # started by this process, reaped by _reap()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused PID apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


@dataclass
class Proc:
    name: str
    pid: int
    started: int

    def alive(self) -> bool:
        return start_time(self.pid) == self.started

    def to_dict(self) -> dict[str, int | str]:
        return {"name": self.name, "pid": self.pid, "started": self.started}

    @classmethod
    def from_dict(cls, d: dict) -> Proc:
        return cls(d["name"], int(d["pid"]), int(d["started"]))


def launch(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    """Start argv in its own session (it outlives the caller), output appended to log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
    _CHILDREN[p.pid] = p
    started = None
    for _ in range(100):
        started = start_time(p.pid)
        if started is not None or p.poll() is not None:
            break
        time.sleep(0.01)
    if started is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(
            f"{name} exited at once ({argv[0]}); last log lines:\n" + "\n".join(tail)
        )
    return Proc(name, p.pid, started)


def stop(procs: list[Proc], *, grace_seconds: float = 10.0) -> list[str]:
    """SIGTERM each (its process group too), wait up to grace_seconds, then SIGKILL."""
    alive = [p for p in procs if p.alive()]
    for p in alive:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and any(p.alive() for p in alive):
        _reap()
        time.sleep(0.05)
    for p in alive:
        if p.alive():
            _signal(p, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(p.alive() for p in alive):
        _reap()
        time.sleep(0.05)
    return [p.name for p in alive]


def _signal(p: Proc, sig: int) -> None:
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, sig)
        else:
            os.kill(p.pid, sig)
    except ProcessLookupError:
        pass


def _reap() -> None:
    """Collect exit statuses of the children launch() started here (never anyone else's)."""
    for pid, p in list(_CHILDREN.items()):
        if p.poll() is not None:
            del _CHILDREN[pid]


def stray_processes(marker: str, names: tuple[str, ...]) -> list[Proc]:
    """Processes whose command line mentions marker (a state dir) and one of names."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and any(n in cmd for n in names):
            st = start_time(int(entry.name))
            if st is not None:
                found.append(Proc(cmd.split(" ", 1)[0], int(entry.name), st))
    return found
