"""The container runtime: one launcher process per container, signals, exec hooks, mount points.

Processes are started from the event loop's thread only: the launcher's PDEATHSIG is tied to the
thread that forked it, and it must fire when the agent process dies (a node failure kills pods).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import crilog
from .kube import log, now
from .podsecurity import CAPABILITIES, Identity, last_capability

LAUNCHER = Path(__file__).with_name("launcher.py")


def setpriv_prefix(identity: Identity | None) -> list[str]:
    """util-linux setpriv arguments that give an exec'd process the container's identity."""
    if identity is None or (
        identity.uid == os.getuid()
        and identity.gid == os.getgid()
        and not (identity.groups or identity.no_new_privs or identity.drop_capabilities)
    ):
        return []
    cmd = ["setpriv", f"--reuid={identity.uid}", f"--regid={identity.gid}"]
    if identity.groups:
        cmd.append("--groups=" + ",".join(str(g) for g in identity.groups))
    else:
        cmd.append("--clear-groups")
    if identity.no_new_privs:
        cmd.append("--no-new-privs")
    if identity.drop_capabilities:
        caps = identity.drop_capabilities
        everything = len(caps) >= len(CAPABILITIES) or caps == tuple(range(last_capability() + 1))
        dropped = "-all" if everything else ",".join(f"-{CAPABILITIES[c].lower()}" for c in caps)
        cmd += [f"--bounding-set={dropped}", f"--inh-caps={dropped}"]
    return [*cmd, "--"]


class StartError(RuntimeError):
    """The container's process could not start (reason StartError, exit code 128)."""


def remove_recorded(record: Path) -> None:
    """Remove the (still empty) mount points a killed agent left behind, deepest first."""
    try:
        paths = [Path(p) for p in json.loads(record.read_text())]
    except (OSError, ValueError):
        return
    for q in sorted(paths, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            if q.is_dir():
                q.rmdir()
            elif q.stat().st_size == 0:
                q.unlink()
    record.unlink(missing_ok=True)


class HostPaths:
    """Mount points a pod needs that do not exist on the host: created, shared, removed again.

    Bind mounts happen in each pod's private mount namespace, but the directory (or file) they
    cover must exist in the shared file system. Paths the agent created are reference-counted
    and removed (only if still empty) when the last pod using them is gone.
    """

    def __init__(self, record: Path | None = None) -> None:
        self._refs: dict[Path, int] = {}
        self._record = record  # what is held, for `down` to clean up after a killed agent

    def _save(self) -> None:
        if self._record is not None:
            tmp = self._record.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(str(p) for p in self._refs)))
            tmp.replace(self._record)

    def acquire(self, path: Path, *, is_file: bool = False) -> list[Path]:
        created: list[Path] = []
        missing = []
        p = path
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        for i, m in enumerate(reversed(missing)):
            if is_file and i == len(missing) - 1:
                m.touch()
            else:
                m.mkdir()
            created.append(m)
        held = [*created, *(q for q in self._refs if q in path.parents or q == path)]
        for q in dict.fromkeys(held):
            self._refs[q] = self._refs.get(q, 0) + 1
        self._save()
        return list(dict.fromkeys(held))

    def release(self, paths: list[Path]) -> None:
        for q in sorted(paths, key=lambda p: len(p.parts), reverse=True):
            n = self._refs.get(q, 0) - 1
            if n > 0:
                self._refs[q] = n
                continue
            self._refs.pop(q, None)
            with contextlib.suppress(OSError):
                if q.is_dir():
                    q.rmdir()  # only empty: never remove what someone put there
                elif q.stat().st_size == 0:
                    q.unlink()
        self._save()


@dataclass
class ContainerProcess:
    """One run of a container: its launcher, the host PID of its namespace's PID 1, its result."""

    name: str
    spec_file: Path
    log_file: Path
    proc: asyncio.subprocess.Process | None = None
    init_pid: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    started_mono: float = field(default_factory=time.monotonic)

    async def start(self, launch: dict[str, Any], *, timeout: float = 30) -> None:
        """Run launcher.py; returns once the exec succeeded, raises StartError otherwise.

        The launcher writes the container's output to log_file as CRI records; its own output
        (a crash of the launcher) goes there as plain lines."""
        self.spec_file.write_text(json.dumps({**launch, "logPath": str(self.log_file)}))
        r, w = os.pipe()
        try:
            with self.log_file.open("ab") as out:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-S",
                    str(LAUNCHER),
                    str(self.spec_file),
                    str(w),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    pass_fds=(w,),
                    start_new_session=True,
                )
        finally:
            os.close(w)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", 0)
        )
        try:
            line = await asyncio.wait_for(reader.readline(), timeout)
        except asyncio.TimeoutError:
            line = b""
        finally:
            transport.close()
        try:
            event = json.loads(line) if line else {}
        except ValueError:
            event = {}
        if event.get("event") == "started":
            self.init_pid = int(event["pid"])
            self.started_at = now()
            self.started_mono = time.monotonic()
            return
        await self.kill_and_wait()
        self.exit_code = 128
        self.finished_at = now()
        raise StartError(
            event.get("message") or f"the launcher did not start (log {self.log_file})"
        )

    def signal(self, sig: int) -> None:
        for pid in (self.init_pid, self.proc.pid if self.proc else None):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                return

    async def wait(self) -> int:
        assert self.proc is not None
        rc = await self.proc.wait()
        if self.exit_code is None:
            self.exit_code = 128 - rc if rc < 0 else rc
            self.finished_at = now()
        return self.exit_code

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill_and_wait(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(Exception):
            await self.wait()

    async def stop(self, deadline: float) -> int | None:
        """SIGTERM (PID 1 forwards it to the command), SIGKILL at deadline (monotonic)."""
        if not self.running:
            return self.exit_code
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(
                asyncio.shield(self.wait()), max(0.0, deadline - time.monotonic())
            )
        except asyncio.TimeoutError:
            log.info("container %s still runs at the end of its grace period: SIGKILL", self.name)
        self.signal(signal.SIGKILL)
        return await self.wait()

    def exec_argv(
        self,
        argv: list[str],
        *,
        cwd: str | None,
        identity: Identity | None,
        tty: bool = False,
    ) -> list[str]:
        """The host command that runs argv inside the container: its mount, PID, network and UTS
        namespaces (nsenter; in the pod's network namespace the pod's NetworkPolicies cover what
        it connects to, by its address), its identity (setpriv: an exec is no way back to root),
        a session of its own on the terminal with tty (setsid -c: job control, ^C)."""
        if not self.init_pid:
            raise StartError(f"container {self.name} is not running")
        cmd = ["nsenter", f"--target={self.init_pid}", "--mount", "--pid", "--net", "--uts"]
        if cwd:
            cmd.append(f"--wd={cwd}")
        cmd.append("--")
        if tty:
            cmd += ["setsid", "--wait", "--ctty"]
        cmd += [*setpriv_prefix(identity), *argv]
        return cmd

    async def exec(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        timeout: float,
        *,
        identity: Identity | None = None,
    ) -> int:
        """Run argv inside the container as a preStop or probe exec (see exec_argv); its output
        goes to the container's log, as CRI records."""
        if not self.running or not self.init_pid:
            return -1
        cmd = self.exec_argv(argv, cwd=cwd, identity=identity)
        p = await asyncio.create_subprocess_exec(
            *cmd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        log_fd = os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

        async def copy(stream: asyncio.StreamReader | None, name: str) -> None:
            writer = crilog.StreamWriter(log_fd, name)
            while stream is not None and (chunk := await stream.read(65536)):
                writer.feed(chunk)
            writer.close()

        try:
            await asyncio.wait_for(
                asyncio.gather(copy(p.stdout, "stdout"), copy(p.stderr, "stderr"), p.wait()),
                max(0.1, timeout),
            )
            return p.returncode if p.returncode is not None else -1
        except asyncio.TimeoutError:
            kill_session(p.pid)
            await p.wait()
            return -1
        finally:
            os.close(log_fd)


def kill_session(pid: int) -> None:
    """SIGKILL an exec's process group (nsenter and the command it forked into the pod)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
