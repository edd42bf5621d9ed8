"""The local Dask executor: a cluster's scheduler and workers as processes of its owner's account.

The hub's cluster service calls ``LocalDaskExecutor`` (a ``gpulab.hub.daskservice.DaskExecutor``)
on the embedded default: ``start_scheduler`` once the scheduler's allocation is placed,
``start_worker`` for every admitted worker, ``stop``, ``running`` and ``exit_reason`` with the
handles it stored (after a hub restart too). Processes start as job attempts do
(``gpulab.spawner.local.processes``): the owner's uid, gid and groups, a session of their own, a
clean environment with nothing of the hub's, cwd ``/`` (the hub never enters a directory its
user controls as root).

Scheduler: ``python -m gpulab.spawner.singleuser.dask_scheduler`` (``dask scheduler`` with the
dashboard prefix from the config), TLS on 127.0.0.1, a port it picks itself (``--port 0``) and
writes with its dashboard's to its ``--scheduler-file``. The hub reads that file, checks that both
ports are listened on by the owner's account (the file is hers: she could name another port) and
that the scheduler accepts the cluster's TLS credentials, then answers ``SchedulerStarted`` with
``tls://127.0.0.1:<port>`` and ``http://127.0.0.1:<dashboard port>/<prefix>`` (the hub's proxy
appends ``/status`` and the like).

Workers: ``python -m gpulab.spawner.singleuser.dask_worker`` (``dask cuda worker`` where the
placement holds a GPU and dask_cuda is importable, else a plain ``dask worker``; the log's first
line says which), named ``worker_name(number)``, on 127.0.0.1 (``--host``), no dashboard of their
own, ``--nthreads`` and ``--memory-limit`` from the profile's CPU and memory, and the placement's
environment as a job attempt gets it (CUDA_VISIBLE_DEVICES with the GPU or MIG UUID, the
GPULAB_* share variables, the framework caps hook) plus the cluster's own ``environment``.

Warm starts. A scheduler or worker started cold spends most of its start importing
distributed (bokeh too, for a scheduler's dashboard). So each owner gets a fork server
(``gpulab.spawner.singleuser.dask_forkserver``): one process of hers, started with the same
clean environment as the rest, that imports all of it once and forks every scheduler and worker
the executor asks for, each in a session of its own with exactly the environment and log a cold
start gets. It talks to the hub over a socket pair only the hub holds the other end of; every
pid it reports is checked against the kernel (her uid, its own session, a child of the fork
server) before the hub takes it for its own, since she can write to her own process. It ends
when the hub closes its end (``close()``, or the hub's exit) or after ``forkserver_idle_seconds``
with no child; a fork server that cannot start (or dies) only makes starts cold again.

Files and their owners::

    <state_dir>/dask-clusters/          root 0711 (the hub's)
      forkserver-<uid>.log              root 0600: the owner's fork server's own messages
      cluster-<id>/                     root:<owner's group> 0750 (0711 if that group is shared)
        tls.crt, tls.key                the owner's, 0600: the cluster's ClusterTLS
        dask.yaml                       the owner's, 0600: TLS paths, require-encryption, the
                                        dashboard prefix (DASK_CONFIG of every process)
        scheduler.log, w<n>.log         root:<owner's group> 0640 (0600 if shared), appended
                                        (kept after the cluster ended; the rest goes then)
        run/                            the owner's, 0700: scheduler files, workers' spill
                                        (Dask's temporary-directory)

Why no other account gets in. The scheduler runs any code a connected client sends, as the
owner, and any local account reaches 127.0.0.1. So every process requires mutual TLS
(``distributed.comm.require-encryption``) with the cluster's own certificate, which is its own
CA: a peer without it, or with another cluster's, fails the handshake. The key and config are
0600 files of the owner in a directory other accounts cannot list, and never in argv (every
account reads /proc/<pid>/cmdline) nor in the environment of another account. The dashboard
(HTTP, no code execution, but the owner's task names and data sizes) listens on 127.0.0.1 under a
random prefix derived from the cluster's key, given in the 0600 config only; the hub's proxy
alone is told it (``dashboard_url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import ssl
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from gpulab.hub.allocator import Placement
from gpulab.hub.dask import Cluster, Worker, worker_name
from gpulab.hub.daskservice.executor import ClusterTLS, Handle, SchedulerStarted
from gpulab.spawner.environment import assigned_gpus, gpu_environment, with_caps_hook
from gpulab.spawner.gpu_mixin import inventory_environment
from gpulab.spawner.local.accounts import SystemAccount
from gpulab.spawner.local.processes import (
    ProcessError,
    Sessions,
    Started,
    boot_id,
    check_hub_root,
    check_identity,
    clean_environment,
    hub_dir,
    open_hub_file,
    private_group,
    proc_stat,
    read_small,
)
from gpulab.spawner.names import CAPS_HOOK_ENV
from gpulab.spawner.singleuser.dask_scheduler import DASHBOARD_PREFIX_KEY

Role = Literal["scheduler", "worker"]

SCHEDULER_MODULE = "gpulab.spawner.singleuser.dask_scheduler"
WORKER_MODULE = "gpulab.spawner.singleuser.dask_worker"
FORKSERVER_MODULE = "gpulab.spawner.singleuser.dask_forkserver"
#: the Python start-up variables a forked process honours like a new interpreter (the fork
#: server applies PYTHONPATH; PYTHONUNBUFFERED is in every environment it starts from); any
#: other PYTHON* variable changes how Python starts, so such a process starts cold
FORKABLE_PYTHON_VARIABLES = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED"})
#: after a fork server failed to start, starts stay cold this long before it is tried again
FORKSERVER_RETRY_SECONDS = 60.0
#: how long a fork server may take to answer a start
FORKSERVER_ANSWER_SECONDS = 10.0
#: a scheduler file is a small JSON object; anything longer is not the scheduler's
MAX_SCHEDULER_FILE_BYTES = 1 << 16
LOG = logging.getLogger("gpulab.dask")
_ADDRESS = re.compile(r"tls://127\.0\.0\.1:(?P<port>[0-9]{1,5})")


class DaskExecutorError(ProcessError):
    """A scheduler or worker could not be started or stopped; the message says why."""


@dataclass(frozen=True)
class ProcessHandle:
    """A started scheduler or worker, as plain values the service stores (``to_dict``).

    ``pid`` leads the process's session; ``start_ticks`` (field 22 of /proc/<pid>/stat) and
    ``boot_id`` tell it from a later process with the same pid."""

    role: Role
    cluster_id: int
    worker: int | None  # the worker's number; None for the scheduler
    pid: int
    start_ticks: int
    boot_id: str
    uid: int
    started_at: float
    log: str  # hub-owned: the process's stdout and stderr

    @property
    def label(self) -> str:
        what = "scheduler" if self.worker is None else f"worker {worker_name(self.worker)}"
        return f"the {what} of Dask cluster {self.cluster_id}"

    @property
    def ended_by_path(self) -> str:
        return f"{self.log.removesuffix('.log')}.ended-by"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProcessHandle:
        names = {f.name for f in fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"a Dask process handle needs {', '.join(sorted(missing))}")
        return cls(**{k: data[k] for k in names})


@dataclass(frozen=True)
class ClusterFiles:
    """Where one cluster's files are (see the module docstring)."""

    root: Path

    @property
    def cert(self) -> Path:
        return self.root / "tls.crt"

    @property
    def key(self) -> Path:
        return self.root / "tls.key"

    @property
    def config(self) -> Path:
        return self.root / "dask.yaml"

    @property
    def run(self) -> Path:
        return self.root / "run"

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"


def dashboard_prefix(tls: ClusterTLS) -> str:
    """The dashboard's secret path prefix: derived from the cluster's key, so every start of
    the cluster (and the hub after a restart) computes the same one, and no one without the key
    (who could run code in the cluster anyway) can guess it."""
    digest = hmac.new(tls.key_pem.encode(), b"gpulab dask dashboard prefix", hashlib.sha256)
    return digest.hexdigest()[:32]


def dask_config(files: ClusterFiles, tls: ClusterTLS) -> dict[str, Any]:
    """The Dask config of every process of the cluster (its ``DASK_CONFIG``)."""
    pair = {"cert": str(files.cert), "key": str(files.key)}
    return {
        "distributed": {
            "comm": {
                # nothing connects without the cluster's certificate, whatever the address
                "require-encryption": True,
                "default-scheme": "tls",
                "tls": {
                    "ca-file": str(files.cert),
                    "scheduler": pair,
                    "worker": pair,
                    "client": pair,
                },
            },
        },
        "temporary-directory": str(files.run),
        # nested as dask.config.get reads a dotted key
        DASHBOARD_PREFIX_KEY.split(".")[0]: {
            DASHBOARD_PREFIX_KEY.split(".")[1]: dashboard_prefix(tls)
        },
    }


def uses_dask_cuda_here(placement: Placement) -> bool:
    """Whether the worker gets ``--gpu`` (its placement holds a GPU share); the launcher then
    runs dask-cuda's worker where dask_cuda is importable."""
    return bool(placement.gpus)


def worker_args(
    placement: Placement, scheduler_address: str, number: int, python: str
) -> list[str]:
    """The worker's command: the launcher (which picks dask-cuda's worker or a plain one), the
    scheduler, its name, loopback only, no dashboard of its own, threads and memory from the
    profile (``--nthreads`` from the CPU share, at least one; ``--memory-limit`` from the memory,
    Dask's own default where the profile sets none)."""
    if not _ADDRESS.fullmatch(scheduler_address):
        raise DaskExecutorError(
            f"a local scheduler's address is tls://127.0.0.1:<port>, got {scheduler_address!r:.80}"
        )
    argv = [python, "-m", WORKER_MODULE]
    if uses_dask_cuda_here(placement):
        argv.append("--gpu")
    argv += [
        "--",
        scheduler_address,
        "--name",
        worker_name(number),
        "--host",
        "127.0.0.1",
        "--no-dashboard",
        "--nthreads",
        str(max(1, math.ceil(placement.request.cpu_milli / 1000))),
    ]
    if placement.request.memory_mib:
        argv += ["--memory-limit", f"{placement.request.memory_mib}MiB"]
    return argv


def _listener_uid(port: int) -> int | None:
    """The uid of the socket listening on 127.0.0.1:``port`` (/proc/net/tcp), or None."""
    want = f"0100007F:{port:04X}"
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) > 7 and parts[1] == want and parts[3] == "0A":  # 0A: LISTEN
            return int(parts[7])
    return None


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a process with ``env`` may be forked by the fork server (pure): no Python
    start-up variable but those it applies (``FORKABLE_PYTHON_VARIABLES``)."""
    return not any(
        name.startswith("PYTHON") and name not in FORKABLE_PYTHON_VARIABLES for name in env
    )


def _ppid(pid: int) -> int | None:
    """The parent pid of ``pid`` (/proc/<pid>/stat field 4), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class ForkServer:
    """The hub's end of one owner's fork server (see the module docstring): requests out,
    answers and children's exit statuses in, read by the event loop (no thread waits on it)."""

    def __init__(self, started: Started, control: socket.socket, uid: int) -> None:
        self.started, self.control, self.uid = started, control, uid
        self.control.setblocking(False)
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[int] = loop.create_future()
        self.answers: dict[int, asyncio.Future[dict[str, Any]]] = {}
        #: pid -> exit status (Popen's convention) of the children that ended
        self.exited: dict[int, int] = {}
        self.exit_seen = asyncio.Event()
        self.closed = False
        self._ids = itertools.count(1)
        loop.add_reader(self.control.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data = self.control.recv(MAX_SCHEDULER_FILE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        try:
            message = json.loads(data)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            return  # the owner's process said something else: nothing of it is trusted anyway
        if message.get("ready") is True and not self.ready.done():
            self.ready.set_result(self.started.pid)
        elif isinstance(message.get("exited"), int) and isinstance(message.get("status"), int):
            self.exited[message["exited"]] = message["status"]
            self.exit_seen.set()
            self.exit_seen = asyncio.Event()
        elif isinstance(message.get("id"), int):
            answer = self.answers.pop(message["id"], None)
            if answer is not None and not answer.done():
                answer.set_result(message)

    async def start(self, launcher: str, argv: list[str], env: Mapping[str, str], log: int) -> int:
        """Fork ``launcher`` with ``argv``, ``env`` and ``log`` as stdout/stderr; the pid it
        reports (unchecked: the caller checks it)."""
        if self.closed:
            raise DaskExecutorError("the fork server has ended")
        request_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self.answers[request_id] = answer
        request = {"id": request_id, "launcher": launcher, "argv": argv, "env": dict(env)}
        try:
            socket.send_fds(self.control, [json.dumps(request).encode()], [log])
            message = await asyncio.wait_for(answer, FORKSERVER_ANSWER_SECONDS)
        except (OSError, TimeoutError) as e:
            self.answers.pop(request_id, None)
            raise DaskExecutorError(f"the fork server did not take the start: {e}") from e
        pid = message.get("pid")
        if not isinstance(pid, int):
            raise DaskExecutorError(
                f"the fork server refused the start: {message.get('error')!s:.200}"
            )
        return pid

    async def exit_status(self, pid: int, wait: float) -> int | None:
        """The exit status of child ``pid``, waiting up to ``wait`` s for its report."""
        give_up = time.monotonic() + wait
        while pid not in self.exited and not self.closed and time.monotonic() < give_up:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.exit_seen.wait(), give_up - time.monotonic())
        return self.exited.get(pid)

    def close(self) -> None:
        """Close the hub's end: the fork server ends (its children live on)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.control.fileno())
        self.control.close()
        for answer in self.answers.values():
            if not answer.done():
                answer.set_exception(DaskExecutorError("the fork server ended"))
        self.answers.clear()
        if not self.ready.done():
            self.ready.set_exception(DaskExecutorError("the fork server ended as it started"))
        self.exit_seen.set()


class LocalDaskExecutor:
    """Runs Dask clusters' schedulers and workers as processes of their owners' accounts.

    ``state_dir``: the hub's folder (clusters' files go to ``<state_dir>/dask-clusters``);
    ``account_for(owner)``: the owner's system account and home (made where needed, as the
    local spawner does for servers; the spawner class refuses owners whose servers share the
    hub's account); ``gpu_of(uuid)``: the inventory's GPU behind a share. ``start_timeout``:
    how long a scheduler may take to accept TLS connections before the start counts as failed.
    ``forkserver``: start processes warm, forked by the owner's fork server (module docstring);
    ``forkserver_idle_seconds``: how long a fork server with no child waits for the next start.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        account_for: Callable[[str], Awaitable[tuple[SystemAccount, str]]],
        gpu_of: Callable[[str], Any],
        *,
        python: str = sys.executable,
        start_timeout: float = 60.0,
        poll_seconds: float = 0.1,
        forkserver: bool = True,
        forkserver_idle_seconds: float = 60.0,
        inventory_of: Callable[[str], str] = lambda node: "",
    ) -> None:
        self.clusters_dir = Path(state_dir) / "dask-clusters"
        self.account_for, self.gpu_of = account_for, gpu_of
        #: how a node's GPUs are known ("declared", "simulated", "" when measured), so that
        #: a worker on declared GPUs simulates its share's figures as a server there does
        self.inventory_of = inventory_of
        self.python = python
        self.start_timeout = start_timeout
        self.poll_seconds = poll_seconds
        self.sessions = Sessions(error=DaskExecutorError, poll_seconds=poll_seconds)
        check_hub_root(self.clusters_dir, "Dask clusters directory", DaskExecutorError)
        self.use_forkserver = forkserver
        self.forkserver_idle_seconds = forkserver_idle_seconds
        self._forkservers: dict[int, ForkServer] = {}
        self._forkserver_starts: dict[int, asyncio.Task[ForkServer | None]] = {}
        self._forkserver_failed_at: dict[int, float] = {}
        #: (pid, start ticks) of every process a fork server started -> that fork server
        self._forked: dict[tuple[int, int], ForkServer] = {}

    # -- files -----------------------------------------------------------------------------------

    def _write_owner_file(self, path: Path, text: str, account: SystemAccount) -> None:
        """Replace ``path`` by a 0600 file of the owner's holding ``text`` (written under a
        temporary name and renamed, so a process never reads half of it)."""
        temporary = path.with_name(f".{path.name}.new")
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        fd = os.open(
            temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            if os.geteuid() == 0:
                os.fchown(fd, account.uid, account.gid)
            os.fchmod(fd, 0o600)
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(temporary, path)

    def _prepare(self, cluster: Cluster, account: SystemAccount, tls: ClusterTLS) -> ClusterFiles:
        """The cluster's directory with its TLS files and config (rewritten at every start: the
        same content for the same credentials) and the owner's ``run/``."""
        private = private_group(account)
        files = ClusterFiles(self.clusters_dir / f"cluster-{cluster.id}")
        # her processes must pass through it; others may not list it (and read none of its files)
        hub_dir(
            files.root,
            0o750 if private else 0o711,
            account.gid if private else None,
            DaskExecutorError,
        )
        self._write_owner_file(files.cert, tls.cert_pem, account)
        self._write_owner_file(files.key, tls.key_pem, account)
        self._write_owner_file(files.config, yaml.safe_dump(dask_config(files, tls)), account)
        with contextlib.suppress(FileExistsError):
            files.run.mkdir(mode=0o700)
            if os.geteuid() == 0:
                os.chown(files.run, account.uid, account.gid, follow_symlinks=False)
        st = files.run.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != account.uid:
            raise DaskExecutorError(
                f"{files.run} is not a directory of {account.name!r}; remove it"
            )
        return files

    def _environment(
        self, account: SystemAccount, home: str, files: ClusterFiles, extra: Mapping[str, str]
    ) -> dict[str, str]:
        env = clean_environment(self.python, home, account)
        env.update(extra)
        env["DASK_CONFIG"] = str(files.config)
        return env

    # -- start -----------------------------------------------------------------------------------

    def _open_log(self, files: ClusterFiles, number: int | None, account: SystemAccount) -> int:
        private = private_group(account)
        return open_hub_file(
            str(files.log("scheduler" if number is None else worker_name(number))),
            os.O_WRONLY | os.O_CREAT | os.O_APPEND,
            0o640 if private else 0o600,
            account.gid if private else None,
        )

    async def _launch(
        self,
        role: Role,
        cluster: Cluster,
        number: int | None,
        args: list[str],
        account: SystemAccount,
        files: ClusterFiles,
        env: Mapping[str, str],
        first_line: str = "",
    ) -> ProcessHandle:
        """Start the scheduler's or a worker's launcher with ``args``: forked by the owner's
        fork server where it runs, else cold (a new Python)."""
        groups = await asyncio.to_thread(
            check_identity, account, f"a Dask {role}", DaskExecutorError
        )
        fd = await asyncio.to_thread(self._open_log, files, number, account)
        try:
            if first_line:
                os.write(fd, f"{first_line}\n".encode())
            started_at = time.time()
            server = await self._forkserver(account, env["HOME"]) if forkable(env) else None
            started: Started | None = None
            if server is not None:
                try:
                    started = await self._forked_start(server, role, args, env, fd, account)
                except DaskExecutorError as e:
                    LOG.warning("gpulab: a warm Dask %s start failed, starting cold: %s", role, e)
            if started is None:
                module = SCHEDULER_MODULE if role == "scheduler" else WORKER_MODULE
                argv = [self.python, "-m", module, *args]
                started = await asyncio.to_thread(
                    self.sessions.spawn,
                    argv,
                    account=account,
                    groups=groups,
                    env=env,
                    stdout=fd,
                    stderr=fd,
                )
        finally:
            os.close(fd)
        handle = ProcessHandle(
            role=role,
            cluster_id=cluster.id,
            worker=number,
            pid=started.pid,
            start_ticks=started.start_ticks,
            boot_id=started.boot_id,
            uid=account.uid,
            started_at=started_at,
            log=str(files.log("scheduler" if number is None else worker_name(number))),
        )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.ended_by_path)
        return handle

    async def _forked_start(
        self,
        server: ForkServer,
        role: Role,
        args: list[str],
        env: Mapping[str, str],
        log: int,
        account: SystemAccount,
    ) -> Started:
        pid = await server.start(role, args, env, log)
        # the pid comes from the owner's process: taken only if the kernel agrees
        st = await asyncio.to_thread(proc_stat, pid)
        if st is None:
            status = await server.exit_status(pid, 1.0)
            raise DaskExecutorError(f"the forked {role} ended as it started (status {status})")
        if (
            st.sid != pid
            or await asyncio.to_thread(_ppid, pid) != server.started.pid
            or await asyncio.to_thread(_uid_of, pid) != account.uid
        ):
            # a fork server that names what it did not start is trusted no more: it ends
            self._forkserver_failed_at[account.uid] = time.monotonic()
            await self._end_forkserver(server)
            raise DaskExecutorError(
                f"the fork server named process {pid}, which is not a child of its own leading "
                f"a session as {account.name!r}"
            )
        self._forked[(pid, st.start_ticks)] = server
        return Started(pid, st.start_ticks, boot_id())

    async def _forkserver(self, account: SystemAccount, home: str) -> ForkServer | None:
        """The owner's running fork server, started where needed; None where there is none
        (turned off, failed lately): starts are then cold."""
        if not self.use_forkserver:
            return None
        server = self._forkservers.get(account.uid)
        if server is not None and not server.closed:
            return server
        failed_at = self._forkserver_failed_at.get(account.uid)
        if failed_at is not None and time.monotonic() - failed_at < FORKSERVER_RETRY_SECONDS:
            return None
        starting = self._forkserver_starts.get(account.uid)
        if starting is None:
            starting = asyncio.ensure_future(self._start_forkserver(account, home))
            self._forkserver_starts[account.uid] = starting
            starting.add_done_callback(lambda _t: self._forkserver_starts.pop(account.uid, None))
        return await asyncio.shield(starting)

    async def _start_forkserver(self, account: SystemAccount, home: str) -> ForkServer | None:
        # (the account's groups and the hub's log file: system calls, off the event loop)
        groups = await asyncio.to_thread(
            check_identity, account, "a Dask fork server", DaskExecutorError
        )
        log = str(self.clusters_dir / f"forkserver-{account.uid}.log")
        fd = await asyncio.to_thread(
            open_hub_file, log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600, None
        )
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [
            self.python,
            "-m",
            FORKSERVER_MODULE,
            "--control-fd",
            str(theirs.fileno()),
            "--idle-seconds",
            f"{self.forkserver_idle_seconds:g}",
        ]
        try:
            started = await asyncio.to_thread(
                self.sessions.spawn,
                argv,
                account=account,
                groups=groups,
                env=clean_environment(self.python, home, account),
                stdout=fd,
                stderr=fd,
                pass_fds=(theirs.fileno(),),
            )
        except Exception as e:
            ours.close()
            self._forkserver_failed_at[account.uid] = time.monotonic()
            LOG.warning(
                "gpulab: no Dask fork server for %s (starts stay cold): %s", account.name, e
            )
            return None
        finally:
            theirs.close()
            os.close(fd)
        server = ForkServer(started, ours, account.uid)
        try:
            await asyncio.wait_for(server.ready, self.start_timeout)
        except (DaskExecutorError, TimeoutError) as e:
            server.close()
            await self.sessions.stop(
                started.pid, started.start_ticks, started.boot_id, 0.0, "a Dask fork server"
            )
            self._forkserver_failed_at[account.uid] = time.monotonic()
            LOG.warning(
                "gpulab: the Dask fork server of %s did not start (starts stay cold; its log: "
                "%s): %s",
                account.name,
                log,
                e,
            )
            return None
        self._forkservers[account.uid] = server
        return server

    async def _end_forkserver(self, server: ForkServer) -> None:
        if self._forkservers.get(server.uid) is server:
            del self._forkservers[server.uid]
        server.close()
        st = server.started
        await self.sessions.stop(st.pid, st.start_ticks, st.boot_id, 5.0, "a Dask fork server")

    async def close(self) -> None:
        """End every fork server (clusters keep running; a later start makes a new one)."""
        for server in list(self._forkservers.values()):
            await self._end_forkserver(server)

    async def _account(self, owner: str) -> tuple[SystemAccount, str]:
        account, home = await self.account_for(owner)
        if not os.path.isabs(home):
            raise DaskExecutorError(f"the owner's home must be an absolute path, got {home!r:.80}")
        return account, home

    async def start_scheduler(
        self, cluster: Cluster, placement: Placement, tls: ClusterTLS
    ) -> SchedulerStarted:
        account, home = await self._account(cluster.owner)
        files = await asyncio.to_thread(self._prepare, cluster, account, tls)
        # a fresh name per start: a file an earlier scheduler left is never taken for this one's
        scheduler_file = files.run / f"scheduler-{os.urandom(6).hex()}.json"
        args = [
            "--scheduler-file",
            str(scheduler_file),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--protocol",
            "tls",
            "--dashboard-address",
            "127.0.0.1:0",
        ]
        env = self._environment(account, home, files, {})
        handle = await self._launch("scheduler", cluster, None, args, account, files, env)
        try:
            address, dashboard_port = await self._wait_ready(handle, scheduler_file, files)
        except BaseException:
            await self._stop(handle, 0.0)
            raise
        prefix = dashboard_prefix(tls)
        return SchedulerStarted(
            handle=handle.to_dict(),
            address=address,
            dashboard_url=f"http://127.0.0.1:{dashboard_port}/{prefix}",
        )

    def _read_scheduler_file(self, path: Path, uid: int) -> tuple[str, int] | None:
        """(address, dashboard port) from the scheduler's file once it is complete and both ports
        are listened on by the owner's account; None until then. The file is the owner's: what it
        says is checked against the kernel's sockets, never taken on trust."""
        raw = read_small(str(path), MAX_SCHEDULER_FILE_BYTES)
        if not raw:
            return None
        try:
            data = json.loads(raw)
            address = data["address"]
            dashboard_port = data["services"]["dashboard"]
        except (ValueError, KeyError, TypeError):
            return None  # still being written
        match = _ADDRESS.fullmatch(address) if isinstance(address, str) else None
        if match is None or not isinstance(dashboard_port, int) or not 0 < dashboard_port < 65536:
            # its words are not repeated: the file is the owner's, the message the hub's log
            raise DaskExecutorError(
                "the scheduler's file does not name a tls://127.0.0.1 address and a dashboard port"
            )
        for port in (int(match["port"]), dashboard_port):
            if _listener_uid(port) != uid:
                return None
        return address, dashboard_port

    @staticmethod
    def _accepts_tls(address: str, files: ClusterFiles) -> bool:
        """Whether the scheduler completes a mutual TLS handshake with the cluster's
        credentials (as Dask's ``Security`` sets it up: no host name check)."""
        match = _ADDRESS.fullmatch(address)
        assert match is not None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.cert))
        ctx.check_hostname = False
        ctx.load_cert_chain(str(files.cert), str(files.key))
        try:
            with (
                socket.create_connection(("127.0.0.1", int(match["port"])), timeout=5) as sock,
                ctx.wrap_socket(sock) as tls_sock,
            ):
                tls_sock.do_handshake()
                return True
        except (OSError, ssl.SSLError):
            return False

    async def _wait_ready(
        self, handle: ProcessHandle, scheduler_file: Path, files: ClusterFiles
    ) -> tuple[str, int]:
        give_up = time.monotonic() + self.start_timeout
        while True:
            if not await asyncio.to_thread(self._running, handle):
                raise DaskExecutorError(
                    f"{handle.label} ended as it started: {await self.exit_reason(handle.to_dict())}"
                )
            found = await asyncio.to_thread(self._read_scheduler_file, scheduler_file, handle.uid)
            if found is not None and await asyncio.to_thread(self._accepts_tls, found[0], files):
                return found
            if time.monotonic() >= give_up:
                raise DaskExecutorError(
                    f"{handle.label} did not accept TLS connections within "
                    f"{self.start_timeout:g} s (its log: {handle.log})"
                )
            await asyncio.sleep(self.poll_seconds)

    def placement_environment(self, placement: Placement) -> dict[str, str]:
        """The GPU variables of a placement, as a server or job attempt on it gets them."""
        env, _enforcement = gpu_environment(assigned_gpus(placement.gpus, self.gpu_of))
        return env

    def worker_environment(self, cluster: Cluster, placement: Placement) -> dict[str, str]:
        """The cluster's own variables, then the placement's (which the spec cannot name: its
        reserved names are refused), with the caps hook first on PYTHONPATH where it applies."""
        env = dict(cluster.spec.environment)
        gpu_env = self.placement_environment(placement)
        env.update(gpu_env)
        if placement.gpus:
            env.update(inventory_environment(self.inventory_of(placement.node)))
        if gpu_env.get(CAPS_HOOK_ENV) == "1":
            env["PYTHONPATH"] = with_caps_hook(cluster.spec.environment.get("PYTHONPATH"))
        return env

    async def start_worker(
        self,
        cluster: Cluster,
        worker: Worker,
        placement: Placement,
        scheduler_address: str,
        tls: ClusterTLS,
        report: Mapping[str, str] | None = None,
    ) -> Handle:
        argv = worker_args(placement, scheduler_address, worker.number, self.python)
        account, home = await self._account(cluster.owner)
        files = await asyncio.to_thread(self._prepare, cluster, account, tls)
        env = self._environment(account, home, files, self.worker_environment(cluster, placement))
        # the GPU report (its token: reporting for this worker only) in this worker's environment
        # alone: the owner's own process, whose /proc/<pid>/environ no other account reads, reached
        # through the fork server's private socket pair or Popen's env; never argv (world-readable
        # in /proc), never the scheduler's. The spec cannot name these (GPULAB_* is reserved).
        env.update(report or {})
        shares = ", ".join(f"{s.uuid} ({s.milli / 1000:g} GPU)" for s in placement.gpus) or "none"
        handle = await self._launch(
            "worker",
            cluster,
            worker.number,
            argv[3:],  # after python -m WORKER_MODULE
            account,
            files,
            env,
            f"gpulab: worker {worker_name(worker.number)} of cluster {cluster.id} on "
            f"{placement.node}, GPU shares: {shares}",
        )
        return handle.to_dict()

    # -- stop, running, exit reason --------------------------------------------------------------

    def _remove_cluster_files(self, cluster_id: int) -> None:
        files = ClusterFiles(self.clusters_dir / f"cluster-{cluster_id}")
        for path in (files.cert, files.key, files.config):
            for name in (path, path.with_name(f".{path.name}.new")):
                with contextlib.suppress(FileNotFoundError):
                    name.unlink()
        # the owner's folder: rmtree removes its entries without following her symlinks
        shutil.rmtree(files.run, ignore_errors=True)

    async def cluster_ended(self, cluster: Cluster) -> None:
        """Nothing of ``cluster`` runs any more: its TLS key and certificate, its Dask config
        and ``run/`` (scheduler files, the workers' spill) go; its logs stay for its owner and
        the hub's exit reasons."""
        await asyncio.to_thread(self._remove_cluster_files, cluster.id)

    def _running(self, handle: ProcessHandle) -> bool:
        """Whether anything of its session runs: its leader (the scheduler, the worker's nanny)
        or a child it left (a worker process whose nanny was killed still holds the share)."""
        return bool(self.sessions.members(handle.pid, handle.start_ticks, handle.boot_id))

    async def _stop(self, handle: ProcessHandle, grace_seconds: float) -> None:
        await self.sessions.stop(
            handle.pid, handle.start_ticks, handle.boot_id, grace_seconds, handle.label
        )

    def _mark_stopped(self, handle: ProcessHandle) -> None:
        """Record that the hub stopped it (the first word stays), for ``exit_reason``."""
        with contextlib.suppress(FileExistsError, FileNotFoundError):
            fd = open_hub_file(
                handle.ended_by_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, None
            )
            with os.fdopen(fd, "w") as f:
                f.write("stopped")

    async def stop(self, handle: Handle, grace_seconds: float) -> None:
        """SIGTERM to every process of its session, SIGKILL after ``grace_seconds``; returns
        once none is left."""
        process = ProcessHandle.from_dict(handle)
        leader = self.sessions.running
        if await asyncio.to_thread(leader, process.pid, process.start_ticks, process.boot_id):
            await asyncio.to_thread(self._mark_stopped, process)
        await self._stop(process, grace_seconds)

    async def running(self, handle: Handle) -> bool:
        """Whether any process of it still runs (after a hub restart too)."""
        return await asyncio.to_thread(self._running, ProcessHandle.from_dict(handle))

    def _exit_reason(self, process: ProcessHandle, forked_status: int | None) -> str:
        if self._running(process):
            return ""
        ended_by = (read_small(process.ended_by_path, 64) or b"").decode(errors="replace")
        if ended_by == "stopped":
            return "stopped by the hub"
        code = self.sessions.returncode(process.pid, process.start_ticks)
        if code is None:
            code = forked_status
        if code is None:
            return ""  # ended while another hub ran it: no exit status
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name}"
        last = _last_line(process.log)
        said = f": {last}" if code and last else ""
        return f"exited with status {code}{said}"

    async def exit_reason(self, handle: Handle) -> str:
        """'exited with status 1: <the log's last line>', 'killed by SIGKILL', 'stopped by the
        hub'; '' while it runs or when unknown (it ended under an earlier hub)."""
        process = ProcessHandle.from_dict(handle)
        server = self._forked.get((process.pid, process.start_ticks))
        status = None
        if server is not None and not await asyncio.to_thread(self._running, process):
            # its fork server reaps it and reports the status a moment after it ended
            status = await server.exit_status(process.pid, 2.0)
        return await asyncio.to_thread(self._exit_reason, process, status)


def _last_line(path: str, limit: int = 4096) -> str:
    """The last non-empty line of a log (its last ``limit`` bytes), at most 200 characters."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, limit, max(0, size - limit))
    finally:
        os.close(fd)
    lines = [line.strip() for line in data.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""
