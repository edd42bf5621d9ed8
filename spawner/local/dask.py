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
line says which), named ``worker_name(number)``, on 127.0.0.1 (``--host``, its HTTP server's
``--dashboard-address`` too), no dashboard of their own, ``--nthreads`` and ``--memory-limit`` from the profile's CPU and memory, and the placement's
environment as a job attempt gets it (CUDA_VISIBLE_DEVICES with the GPU or MIG UUID, the
GPULAB_* share variables, the framework caps hook) plus the cluster's own ``environment``.

Warm starts. Each owner gets a fork server (``gpulab.spawner.singleuser.dask_forkserver``): one
process of hers that imports distributed once and forks every scheduler and worker the executor
asks for, each in a session of its own with exactly the environment and log a cold start gets;
every pid it reports is checked against the kernel (her uid, its own session, a child of the
fork server) before the hub takes it for its own. A fork server that cannot start (or dies)
only makes starts cold again (``gpulab.spawner.local.forkserver``).

The cluster's files (TLS credentials, Dask config, logs) and who owns each:
``gpulab.spawner.local.dask_files``; the fork server's hub end (and the reaping of its exit):
``gpulab.spawner.local.forkserver``; the commands, the addresses every process listens on
(127.0.0.1 only, the workers' HTTP servers included) and the checks of the scheduler's file:
``gpulab.spawner.local.dask_listeners``.

Why no other account gets in. The scheduler runs any code a connected client sends, as the
owner, and any local account reaches 127.0.0.1 (nothing else does: no process of a cluster
listens on another address). So every process requires mutual TLS
(``distributed.comm.require-encryption``) with the cluster's own certificate, which is its own
CA: a peer without it, or with another cluster's, fails the handshake. The key and config are
0600 files of the owner in a directory other accounts cannot list. The dashboard (HTTP, no code
execution, but the owner's task names and data sizes) listens on 127.0.0.1 under a random prefix
derived from the cluster's key, given in the 0600 config only; the hub's proxy alone is told it
(``dashboard_url``). A worker's own HTTP server (which distributed always starts) serves no route.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from gpulab.hub.allocator import Placement
from gpulab.hub.dask import Cluster, Worker, worker_name
from gpulab.hub.daskservice.executor import ClusterTLS, Handle, SchedulerStarted
from gpulab.spawner.environment import assigned_gpus, gpu_environment, with_caps_hook
from gpulab.spawner.gpu_mixin import inventory_environment
from gpulab.spawner.local.accounts import SystemAccount

# (re-exported: the executor's names, wherever they are defined)
from gpulab.spawner.local.dask_files import (
    ClusterFiles,
    DaskExecutorError,
    dashboard_prefix,
    dask_config,
    last_log_line,
    prepare_cluster_files,
    remove_cluster_files,
)
from gpulab.spawner.local.dask_listeners import (
    SCHEDULER_MODULE,
    WORKER_MODULE,
    accepts_cluster_tls,
    read_scheduler_file,
    scheduler_args,
    worker_args,
)
from gpulab.spawner.local.forkserver import (
    FORKABLE_PYTHON_VARIABLES,
    FORKSERVER_MODULE,
    FORKSERVER_RETRY_SECONDS,
    ForkServer,
    forkable,
    owner_uid,
    parent_pid,
)
from gpulab.spawner.local.processes import (
    Sessions,
    Started,
    boot_id,
    check_hub_root,
    check_identity,
    clean_environment,
    open_hub_file,
    private_group,
    proc_stat,
    read_small,
)
from gpulab.spawner.names import CAPS_HOOK_ENV

__all__ = [
    "FORKABLE_PYTHON_VARIABLES",
    "FORKSERVER_MODULE",
    "ClusterFiles",
    "DaskExecutorError",
    "LocalDaskExecutor",
    "ProcessHandle",
    "dashboard_prefix",
    "dask_config",
    "forkable",
    "worker_args",
]

Role = Literal["scheduler", "worker"]

LOG = logging.getLogger("gpulab.dask")


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

    def _prepare(self, cluster: Cluster, account: SystemAccount, tls: ClusterTLS) -> ClusterFiles:
        return prepare_cluster_files(self.clusters_dir, cluster.id, account, tls)

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
            or await asyncio.to_thread(parent_pid, pid) != server.started.pid
            or await asyncio.to_thread(owner_uid, pid) != account.uid
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
        sessions = self.sessions

        def reap() -> bool:
            # Popen.poll: a waitpid that does not block (the pidfd said it ended)
            if sessions.running(started.pid, started.start_ticks, started.boot_id):
                return False
            sessions.forget(started.pid, started.start_ticks)
            return True

        server = ForkServer(started, ours, account.uid, reap)
        try:
            await asyncio.wait_for(server.ready, self.start_timeout)
        except (DaskExecutorError, TimeoutError) as e:
            server.close()
            await self.sessions.stop(
                started.pid, started.start_ticks, started.boot_id, 0.0, "a Dask fork server"
            )
            server.check_reaped()
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
        server.check_reaped()

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
        args = scheduler_args(scheduler_file)
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

    async def _wait_ready(
        self, handle: ProcessHandle, scheduler_file: Path, files: ClusterFiles
    ) -> tuple[str, int]:
        give_up = time.monotonic() + self.start_timeout
        while True:
            if not await asyncio.to_thread(self._running, handle):
                raise DaskExecutorError(
                    f"{handle.label} ended as it started: {await self.exit_reason(handle.to_dict())}"
                )
            found = await asyncio.to_thread(read_scheduler_file, scheduler_file, handle.uid)
            if found is not None and await asyncio.to_thread(accepts_cluster_tls, found[0], files):
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

    async def cluster_ended(self, cluster: Cluster) -> None:
        """Nothing of ``cluster`` runs any more: its TLS key and certificate, its Dask config
        and ``run/`` (scheduler files, the workers' spill) go; its logs stay for its owner and
        the hub's exit reasons."""
        await asyncio.to_thread(remove_cluster_files, self.clusters_dir, cluster.id)

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
        last = last_log_line(process.log)
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
