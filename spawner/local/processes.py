"""Processes the hub starts as its users' accounts, each in a session of its own: start, find
again after a hub restart, stop. Shared by the local job runner (``jobs.py``: a job attempt) and
the local Dask executor (``dask.py``: a cluster's scheduler and workers).

Start. ``Sessions.spawn`` runs a command with the account's uid, gid and supplementary groups
(``subprocess``'s ``user=``, ``group=``, ``extra_groups=``: set in the forked child before exec,
no ``preexec_fn``), in a new session (``start_new_session``: the process's pid is its session
and process group id), stdin ``/dev/null``, and the environment it is given, which callers
build from ``clean_environment`` so that nothing of the hub's (its tokens) is passed on. uid or
gid 0, or an account in the root group, is refused; a hub that is not root runs only its own
account's processes.

Identity. A started process is plain values a hub persists: its pid, its start time (field 22
of ``/proc/<pid>/stat``) and the boot id, so that a later process with the same pid is never
taken for it. After a restart the hub's new ``Sessions`` is no parent of it and reads /proc.

Stop. ``Sessions.stop`` sends SIGTERM to every process of the session, SIGKILL after the grace,
and returns only when none is left (zombies count as gone: they hold no memory and no GPU).
Limit: a process that calls setsid() itself leaves the session and escapes this (as it would
escape a process group); only a cgroup per session would catch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import signal
import stat
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulab.spawner.local.accounts import SystemAccount

#: the hub gives up on a process that SIGKILL has not ended within this (a task stuck in the
#: kernel, e.g. in a GPU driver call): a stop raises instead of claiming the share is free
KILL_WAIT_SECONDS = 60.0


class ProcessError(Exception):
    """A process could not be started or stopped; the message says why and what to change."""


# -- /proc ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    state: str
    pgid: int
    sid: int
    start_ticks: int


def proc_stat(pid: int) -> ProcStat | None:
    """The fields of ``/proc/<pid>/stat`` the hub uses; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) may hold spaces and ')': the fields follow its last ')'
    rest = text[text.rindex(")") + 2 :].split()
    return ProcStat(rest[0], int(rest[2]), int(rest[3]), int(rest[19]))


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def alive(pid: int, start_ticks: int) -> bool:
    """Whether the process ``pid`` that started at ``start_ticks`` runs (a zombie does not)."""
    st = proc_stat(pid)
    return st is not None and st.start_ticks == start_ticks and st.state not in ("Z", "X")


def session_members(sid: int, leader_start_ticks: int) -> list[int]:
    """The live processes of the session ``sid`` led by the process that started at
    ``leader_start_ticks`` (zombies hold no memory and no GPU: they count as gone).

    The kernel does not hand out a number while a process still uses it as its session or group
    id, so processes in session ``sid`` are the session's unless a process with pid ``sid`` and
    another start time exists: then the number was free again, and every process of the session
    was gone before."""
    leader = proc_stat(sid)
    if leader is not None and leader.start_ticks != leader_start_ticks:
        return []
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        st = proc_stat(int(entry.name))
        if st is not None and st.sid == sid and st.state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def signal_in_session(pid: int, sid: int, signum: int) -> None:
    """Send ``signum`` to ``pid`` if it is still in session ``sid`` (a pidfd pins the process
    between the check and the signal, so a reused pid is never signalled)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        st = proc_stat(pid)
        if st is not None and st.sid == sid:
            signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


# -- files ---------------------------------------------------------------------------------------


def private_group(account: SystemAccount) -> bool:
    """Whether the account's primary group is its own (useradd --user-group: same name, no
    members), so that a file of that group is readable by the owner alone."""
    try:
        group = grp.getgrgid(account.gid)
    except KeyError:
        return False
    return group.gr_name == account.name and not group.gr_mem


def read_small(path: str, limit: int) -> bytes | None:
    """The first ``limit`` bytes of a regular file, or None when it is missing or not one
    (a symlink is not followed: the hub reads files its users may have put there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    finally:
        os.close(fd)


def open_hub_file(path: str, flags: int, mode: int, gid: int | None) -> int:
    """Open (creating) a file of the hub's in a directory of the hub's: root's, of group ``gid``
    (None: root's group) with ``mode`` whatever was there before."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    if os.geteuid() == 0:
        os.fchown(fd, 0, 0 if gid is None else gid)
    os.fchmod(fd, mode)
    return fd


def hub_dir(path: Path, mode: int, gid: int | None, error: type[Exception]) -> None:
    """Make ``path`` (its parent must exist) a directory of the hub's, of group ``gid`` (None:
    root's) and ``mode``; ``error`` when something else is there (someone else's, a symlink)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=mode)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise error(f"{path} is not a directory of the hub's; remove it")
    if os.geteuid() == 0:
        os.chown(path, 0, 0 if gid is None else gid, follow_symlinks=False)
    os.chmod(path, mode, follow_symlinks=False)


def check_hub_root(path: Path, what: str, error: type[Exception]) -> None:
    """Make ``path`` (and its parents) when missing, 0711, and refuse it unless the hub's
    account owns it and no one else may write it."""
    path.mkdir(mode=0o711, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise error(
            f"the {what} {path} must be a directory of the hub's account "
            f"(uid {os.geteuid()}) that no one else may write"
        )


# -- identity and environment --------------------------------------------------------------------


def check_identity(account: SystemAccount, what: str, error: type[Exception]) -> list[int]:
    """The supplementary groups to run ``account`` with; ``error`` for root, an account in the
    root group, or another account than the hub's own when the hub is not root (changing
    identity needs root). ``what``: "a job", "a Dask worker", for the message."""
    if account.uid == 0 or account.gid == 0:
        raise error(
            f"refusing to run {what} as root (account {account.name!r}, uid {account.uid}, "
            f"gid {account.gid}): it runs as its owner's unprivileged account"
        )
    if os.geteuid() != 0:
        if account.uid != os.geteuid():
            raise error(
                f"this hub runs as uid {os.geteuid()} and cannot run {what} as "
                f"{account.name!r} (uid {account.uid}); run the hub as root"
            )
        return []
    groups = os.getgrouplist(account.name, account.gid)
    if 0 in groups:
        raise error(f"refusing to run {what} as {account.name!r}: the account is in the root group")
    return groups


def clean_environment(python: str, home: str, account: SystemAccount) -> dict[str, str]:
    """The environment a user's process starts from: nothing of the hub's (its tokens and
    secrets stay in the hub), the hub's Python first on PATH."""
    return {
        "PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "USER": account.name,
        "LOGNAME": account.name,
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",  # print() reaches the live log at once, not at exit
    }


# -- sessions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """A process started in a session of its own: what tells it from any later process."""

    pid: int
    start_ticks: int
    boot_id: str


class Sessions:
    """Processes this hub started as its users, each leading a session of its own.

    It keeps the ``Popen`` of those it started itself and reaps them (so that /proc/<pid> stays
    until it has looked); those of an earlier hub it finds through /proc. ``error`` is the
    exception type its callers expect (``JobRunnerError``...)."""

    def __init__(self, *, error: type[Exception] = ProcessError, poll_seconds: float = 0.1) -> None:
        self.error = error
        self.poll_seconds = poll_seconds
        self._children: dict[tuple[int, int], subprocess.Popen[bytes]] = {}

    def spawn(
        self,
        argv: Sequence[str],
        *,
        account: SystemAccount,
        groups: list[int],
        env: Mapping[str, str],
        stdout: int,
        stderr: int,
        pass_fds: Sequence[int] = (),
        cwd: str = "/",
    ) -> Started:
        """Start ``argv`` as ``account`` (``groups``: from ``check_identity``) in a new session,
        stdin /dev/null, ``stdout``/``stderr`` on the given descriptors."""
        identity: dict[str, Any] = {}
        if os.geteuid() == 0:
            identity = {"user": account.uid, "group": account.gid, "extra_groups": groups}
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            pass_fds=tuple(pass_fds),
            cwd=cwd,
            env=dict(env),
            start_new_session=True,
            umask=0o022,
            **identity,
        )
        # this object reaps its children itself (poll), so /proc/<pid> stays until then
        st = proc_stat(proc.pid)
        if st is None:
            raise self.error(
                f"process {proc.pid} ({argv[0]}) was reaped by someone else before its start "
                "time could be read"
            )
        self._children[(proc.pid, st.start_ticks)] = proc
        return Started(proc.pid, st.start_ticks, boot_id())

    def running(self, pid: int, start_ticks: int, boot: str) -> bool:
        """Whether the session's leader still runs (reaping it when it is this object's child)."""
        child = self._children.get((pid, start_ticks))
        if child is not None:
            return child.poll() is None
        return boot == boot_id() and alive(pid, start_ticks)

    def members(self, pid: int, start_ticks: int, boot: str) -> list[int]:
        """The session's live processes, its leader reaped first when this object started it."""
        self.running(pid, start_ticks, boot)
        if boot != boot_id():
            return []
        return session_members(pid, start_ticks)

    def returncode(self, pid: int, start_ticks: int) -> int | None:
        """The leader's exit status as ``Popen`` gives it (negative: the signal) when this
        object started and reaped it; None otherwise."""
        child = self._children.get((pid, start_ticks))
        return None if child is None else child.returncode

    def forget(self, pid: int, start_ticks: int) -> None:
        """Drop the ``Popen`` of an ended leader (after its exit status was read)."""
        self._children.pop((pid, start_ticks), None)

    async def stop(
        self, pid: int, start_ticks: int, boot: str, grace_seconds: float, what: str
    ) -> None:
        """SIGTERM to every process of the session, SIGKILL to what is left after
        ``grace_seconds``; returns once none is left (``error`` if SIGKILL does not end them
        within ``KILL_WAIT_SECONDS``). ``what`` names it in that message."""
        kill_at = time.monotonic() + grace_seconds
        give_up = kill_at + KILL_WAIT_SECONDS
        term_sent = False
        while members := await asyncio.to_thread(self.members, pid, start_ticks, boot):
            now = time.monotonic()
            if now >= give_up:
                raise self.error(
                    f"processes {members[:10]} of {what} survived SIGKILL for "
                    f"{KILL_WAIT_SECONDS:.0f} s (stuck in the kernel?)"
                )
            signum: int | None = None
            if now >= kill_at:
                signum = signal.SIGKILL  # again each round: it also reaches late forks
            elif not term_sent:
                signum, term_sent = signal.SIGTERM, True
            if signum is not None:
                for member in members:
                    signal_in_session(member, pid, signum)
            await asyncio.sleep(0.05 if now >= kill_at else min(self.poll_seconds, 0.1))
