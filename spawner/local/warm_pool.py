"""Warm pool members of the embedded default (`GPUWarmPool`'s backend): pre-imported server
processes (`gpulab.spawner.singleuser.warm_server`) on a GPU reservation, bound to the claiming
user's account at claim (that module's docstring states why no other tenant can use one).

The hub holds one end of each member's control channel (a socket pair; the member inherits the
other as its only descriptor beyond stdio), so nobody else can claim or steer a member; when the
hub lets a member go, or stops, the channel closes and the member exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpulab.hub.allocator import Placement
from gpulab.hub.profiles import Profile
from gpulab.hub.warmpoolservice import WarmStartFailed
from gpulab.spawner.environment import assigned_gpus, gpu_environment, with_caps_hook
from gpulab.spawner.names import CAPS_HOOK_ENV

#: what a cold server gets from the hub's environment (JupyterHub's Spawner.env_keep default)
DEFAULT_ENV_KEEP = (
    "PATH",
    "PYTHONPATH",
    "CONDA_ROOT",
    "CONDA_DEFAULT_ENV",
    "VIRTUAL_ENV",
    "LANG",
    "LC_ALL",
    "JUPYTERHUB_SINGLEUSER_APP",
)
MEMBER_MODULE = "gpulab.spawner.singleuser.warm_server"


@dataclass(frozen=True)
class Binding:
    """Whose server a member becomes: her account, home, environment and server arguments."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    env: dict[str, str]
    argv: list[str]
    directory_only: bool


class LocalWarmMember:
    """One member process and the hub's end of its control channel."""

    def __init__(
        self,
        member_id: str,
        profile: str,
        fingerprint: str,
        proc: subprocess.Popen[bytes],
        control: socket.socket,
    ) -> None:
        self.id = member_id
        self.profile = profile
        self.fingerprint = fingerprint
        self.proc = proc
        self.started_at = time.time()
        self._control = control
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ready = False
        #: a claim was sent: it no longer exits when the channel closes (it is a server now)
        self._claimed = False

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None:
            self._reader, self._writer = await asyncio.open_unix_connection(sock=self._control)
        return self._reader, self._writer

    async def _answer(self, timeout: float) -> dict[str, Any]:
        reader, _ = await self._open()
        try:
            line = await asyncio.wait_for(reader.readline(), timeout)
        except TimeoutError:
            raise WarmStartFailed(f"no answer in {timeout:g} s") from None
        if not line:
            raise WarmStartFailed(f"it ended (exit status {self.proc.poll()})")
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise WarmStartFailed(f"unexpected answer {line[:80]!r}")
        return answer

    async def wait_ready(self, timeout: float) -> None:
        answer = await self._answer(timeout)
        if "ready" not in answer:
            raise WarmStartFailed(f"unexpected answer {answer!r:.80}")
        self._ready = True

    async def bind(self, binding: Binding, timeout: float = 10.0) -> int:
        """Make the member `binding`'s server; its pid once it runs as her account (checked from
        outside), else WarmStartFailed (the caller discards the member and starts cold)."""
        _, writer = await self._open()
        claim = {
            "uid": binding.uid,
            "gid": binding.gid,
            "groups": list(binding.groups),
            "home": binding.home,
            "env": binding.env,
            "argv": binding.argv,
            "directory_only": binding.directory_only,
        }
        self._claimed = True
        writer.write(json.dumps(claim).encode() + b"\n")
        await writer.drain()
        answer = await self._answer(timeout)
        if "bound" not in answer:
            raise WarmStartFailed(str(answer.get("refused") or answer)[:200])
        ids = process_ids(self.pid)
        if ids != (binding.uid, binding.gid):
            raise WarmStartFailed(f"runs as uid/gid {ids}, not {binding.uid}/{binding.gid}")
        writer.close()
        return self.pid

    async def discard(self) -> None:
        """Close the channel (a member waiting for a claim exits), then make sure it ended: at
        once for a member that was sent a claim (it may be running a server already)."""
        if self._writer is not None:
            self._writer.close()
        else:
            self._control.close()
        if not self._claimed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.proc.wait, 5)
                return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(self.proc.wait)


def process_ids(pid: int) -> tuple[int, int] | None:
    """(uid, gid) of `pid` when its real, effective, saved and filesystem ids all agree, else
    None (a process half-way through a change of account, or gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    uids = set(fields.get("Uid", "").split())
    gids = set(fields.get("Gid", "").split())
    if len(uids) != 1 or len(gids) != 1:
        return None
    return int(uids.pop()), int(gids.pop())


class LocalWarmBackend:
    """Starts members as the hub's account in a clean environment holding only what a cold
    server would get from the hub (`env_keep`) and its reservation's GPU variables."""

    def __init__(
        self,
        gpu_of: Callable[[str], Any],
        env_keep: tuple[str, ...] = DEFAULT_ENV_KEEP,
        mps_pipe_directory: str = "",
        mps_log_directory: str = "",
        command: tuple[str, ...] = ("jupyterhub-singleuser",),
    ) -> None:
        self.gpu_of = gpu_of
        self.env_keep = env_keep
        self.mps_pipe_directory = mps_pipe_directory
        self.mps_log_directory = mps_log_directory
        self.command = command

    def fingerprint(self, profile: Profile) -> str:
        """The profile's definition, the server command and the Python that runs it: a member
        made from anything else is stale (an admin changed the profile or upgraded the env)."""
        server = shutil.which(self.command[0]) or self.command[0]
        try:
            mtime = os.stat(server).st_mtime_ns
        except OSError:
            mtime = 0
        text = repr((profile, self.command, sys.executable, server, mtime, self.env_keep))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def member_environment(self, placement: Placement) -> dict[str, str]:
        env = {k: os.environ[k] for k in self.env_keep if k in os.environ}
        gpus = assigned_gpus(placement.gpus, self.gpu_of)
        gpu_env, _ = gpu_environment(
            gpus,
            mps_pipe_directory=self.mps_pipe_directory,
            mps_log_directory=self.mps_log_directory,
        )
        env.update(gpu_env)
        if gpu_env.get(CAPS_HOOK_ENV):
            env["PYTHONPATH"] = with_caps_hook(env.get("PYTHONPATH"))
        return env

    async def start_member(
        self, member_id: str, profile: Profile, placement: Placement
    ) -> LocalWarmMember:
        hub_end, member_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # forking a hub with many threads and fds takes a while: not on the event loop
            proc = await asyncio.to_thread(
                subprocess.Popen,
                [sys.executable, "-m", MEMBER_MODULE, "--control-fd", str(member_end.fileno())],
                env=self.member_environment(placement),
                pass_fds=(member_end.fileno(),),
                stdin=subprocess.DEVNULL,
                cwd="/",
                start_new_session=True,  # as a cold server: the hub's signals do not reach it
            )
        except BaseException:
            hub_end.close()
            raise
        finally:
            member_end.close()
        hub_end.setblocking(False)
        return LocalWarmMember(member_id, profile.slug, self.fingerprint(profile), proc, hub_end)
