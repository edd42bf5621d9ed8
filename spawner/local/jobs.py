"""The local job runner: one attempt of a job run as a process tree of its owner's account.

The hub's job service calls ``LocalJobRunner`` on the embedded default once the allocator has
admitted a run: ``start`` an attempt, ``wait`` for its end, ``cancel`` it, ``tail`` its logs,
``list_outputs``, and ``reattach`` after a hub restart. It never acts as root on a path the user
controls and never runs user code as root.

Process tree (the machinery is ``gpulab.spawner.local.processes``, shared with the local Dask
executor). The hub (root) starts ``python -I -m gpulab.spawner.singleuser.jobwrapper run``
with the owner's uid, gid and supplementary groups (``subprocess``'s ``user=``, ``group=``,
``extra_groups=``: set in the forked child before exec, no ``preexec_fn``), in a new session
(``start_new_session``: the wrapper's pid is the attempt's session and process group id), stdin
``/dev/null``, cwd ``/``, and a clean environment: PATH, HOME, USER, LOGNAME, LANG,
PYTHONUNBUFFERED, then the job's environment, the placement's (CUDA_VISIBLE_DEVICES, caps...),
and GPULAB_JOB_RUN_ID, GPULAB_JOB_ATTEMPT, GPULAB_OUTPUT_DIR, GPULAB_CHECKPOINT_DIR. Nothing of
the hub's environment (its tokens) is passed on. The wrapper, as the user, makes the output
directories, enters the input's folder and starts the job as its child in the same session: a
``.py`` script with the hub's Python, a ``.sh`` with ``/bin/sh``, a notebook with papermill
(``jobwrapper notebook``: JSON parameters, the executed notebook in the output directory,
``[cell 3/10] ...`` progress lines on stdout). uid or gid 0, or an account in the root group, is
refused (``JobRunnerError``).

Files and their owners::

    <runs_dir>/                          root 0711 (the hub's, given by the job service)
      run-<id>/attempt-<n>/              root:<owner's group> 0750 (0700 if that group is shared)
        stdout.log, stderr.log           root:<owner's group> 0640, appended through descriptors
        exit.json                        root 0600, written by the wrapper through a descriptor
        spec.json                        root 0600: what was started (holds the job's env)
        handle.json                      root 0600: the RunHandle
        ended-by                         root 0600: "canceled" / "timed_out", the hub's own word
    <home>/<JobSpec.output_dir>/run-<id>/   the owner's, 0700, made by the wrapper as her
      <notebook>.ipynb, parameters.json  the executed notebook and its parameters (notebooks)
      checkpoints/                       GPULAB_CHECKPOINT_DIR, kept across attempts

Logs are one file per attempt and stream (the store keeps log offsets per attempt and stream, so
attempts never mix). They live in the hub's directory, so the hub still has them when the user
deletes her home, and she cannot rewrite them after the fact (she may read them: the directory
and files belong to her private group, made by useradd --user-group; another account reads
nothing). They are not copied into the home: the hub would have to write as root into a tree she
controls, or start another process as her, for a copy she can get through the hub anyway.

Exit status, and why the hub may trust it. The wrapper is a process of the job's owner, so it
cannot write a root-owned file by name; the hub opens ``exit.json`` itself and hands the wrapper
the open descriptor (``--status-fd``; the job's own process does not inherit it). The job could
still forge its status (ptrace its wrapper, or kill it so that none is written): that lies only
about this attempt of its own run, exactly as ``exit 0`` would. It cannot touch another run's
status (another directory, root's), and cancel and timeout are recorded by the hub in
``ended-by``, never taken from the job. The hub reads at most 4 KiB of JSON with two integer
fields, after the wrapper is gone.

Reattach. A ``RunHandle`` is plain JSON: the wrapper's pid, its start time (field 22 of
``/proc/<pid>/stat``) and the boot id, so that a later process with the same pid is never taken
for it. After a restart the hub's new runner is no parent of the wrapper: ``wait`` polls /proc
for pid + start time, enforces the handle's deadline (wall-clock, persisted), and reads the exit
status from ``exit.json`` once the wrapper is gone. ``cancel`` and the timeout send SIGTERM to
every process of the session, SIGKILL after the grace, and return only when none is left
(zombies count as gone: they hold no memory and no GPU); ``wait`` also stops what is left of the
session after the wrapper ended, so that the GPU share may be freed right after it returns.
Limit: a job process that calls setsid() itself leaves the session and escapes this (as it would
escape a process group); only a cgroup per attempt would catch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from gpulab.hub.allocator import Placement
from gpulab.hub.jobs.model import (
    JobSpec,
    Run,
)
from gpulab.spawner.environment import assigned_gpus, gpu_environment, with_caps_hook
from gpulab.spawner.gpu_mixin import inventory_environment
from gpulab.spawner.job_attempt import (
    WRAPPER_MODULE,
    attempt_environment,
    wrapper_spec,
)
from gpulab.spawner.local.accounts import SystemAccount
from gpulab.spawner.local.job_records import (
    CAUSE_TAIL_BYTES,
    MAX_STATUS_BYTES,
    STREAMS,
    JobRunnerError,
    RunAttempt,
    RunHandle,
    RunResult,
    Stream,
    file_size,
    output_files,
    parse_status,
)
from gpulab.spawner.local.processes import (
    Sessions,
    alive,
    boot_id,
    check_hub_root,
    check_identity,
    clean_environment,
    hub_dir,
    open_hub_file,
    private_group,
    read_small,
)
from gpulab.spawner.names import CAPS_HOOK_ENV
from gpulab.spawner.singleuser.jobwrapper import (
    DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
    platform_failure_cause,
)

__all__ = [
    "JobRunnerError",
    "LocalJobExecutor",
    "LocalJobRunner",
    "RunAttempt",
    "RunHandle",
    "RunResult",
    "output_files",
]


# -- the runner ----------------------------------------------------------------------------------


class LocalJobRunner:
    """Runs job attempts as local processes of their owners' accounts.

    ``runs_dir`` is the hub's own directory for job runs (the job service passes one under the
    hub's state directory); it is made 0711 when missing and refused when someone else owns it or
    others may write it. ``grace_seconds`` is how long a timed-out attempt's processes get between
    SIGTERM and SIGKILL; ``poll_seconds`` how often a wait looks at /proc;
    ``kernel_start_timeout_seconds`` how long a notebook's kernel may take to start before the
    attempt failed before the job's code (and is retried as the platform's failure).
    """

    def __init__(
        self,
        runs_dir: str | os.PathLike[str],
        *,
        python: str = sys.executable,
        grace_seconds: float = 10.0,
        straggler_grace_seconds: float = 2.0,
        poll_seconds: float = 0.2,
        kernel_start_timeout_seconds: int = DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
    ) -> None:
        self.runs_dir = Path(runs_dir)
        self.python = python
        #: how long a notebook's kernel may take to start (``GPUJobs.kernel_start_timeout_seconds``)
        self.kernel_start_timeout_seconds = kernel_start_timeout_seconds
        self.grace_seconds = grace_seconds
        self.straggler_grace_seconds = straggler_grace_seconds
        self.poll_seconds = poll_seconds
        #: the wrappers this runner started (it reaps them itself) and those of an earlier hub
        self.sessions = Sessions(error=JobRunnerError, poll_seconds=poll_seconds)
        check_hub_root(self.runs_dir, "job runs directory", JobRunnerError)

    # -- start ---------------------------------------------------------------------------------

    def _environment(self, attempt: RunAttempt) -> dict[str, str]:
        """A clean environment: nothing of the hub's (its tokens and secrets stay in the hub)."""
        env = clean_environment(self.python, attempt.home, attempt.account)
        env.update(attempt.environment)
        env.update(attempt.placement_environment)
        if attempt.placement_environment.get(CAPS_HOOK_ENV) == "1":
            env["PYTHONPATH"] = with_caps_hook(attempt.environment.get("PYTHONPATH"))
        env.update(
            attempt_environment(
                run_id=attempt.run_id,
                attempt=attempt.attempt,
                home=attempt.home,
                output_dir=attempt.output_dir,
            )
        )
        return env

    def _wrapper_spec(self, attempt: RunAttempt) -> dict[str, Any]:
        """What the wrapper runs (it reads this from a descriptor, not from its command line,
        which every account may read in /proc); the same spec as on Kubernetes."""
        try:
            return wrapper_spec(
                kind=attempt.kind,
                path=attempt.path,
                home=attempt.home,
                output_dir=attempt.output_dir,
                run_id=attempt.run_id,
                python=self.python,
                parameters=attempt.parameters,
                args=attempt.args,
                kernel_name=attempt.kernel_name,
                report=attempt.report,
                kernel_start_timeout_seconds=self.kernel_start_timeout_seconds,
            )
        except ValueError as e:
            raise JobRunnerError(str(e)) from None

    def _attempt_dir(self, attempt: RunAttempt, private: bool) -> str:
        """``<runs_dir>/run-<id>/attempt-<n>``, root's; the owner's group may read it when that
        group is hers alone."""
        run_dir = self.runs_dir / f"run-{attempt.run_id}"
        attempt_dir = run_dir / f"attempt-{attempt.attempt}"
        mode = 0o750 if private else 0o700
        for path in (run_dir, attempt_dir):
            hub_dir(path, mode, attempt.account.gid if private else None, JobRunnerError)
        return str(attempt_dir)

    def _spawn(self, attempt: RunAttempt) -> RunHandle:
        groups = check_identity(attempt.account, "a job", JobRunnerError)
        spec = self._wrapper_spec(attempt)
        private = private_group(attempt.account)
        attempt_dir = self._attempt_dir(attempt, private)
        previous = read_small(os.path.join(attempt_dir, "handle.json"), 1 << 16)
        if previous:
            old = RunHandle.from_dict(json.loads(previous))
            if alive(old.pid, old.start_ticks) and old.boot_id == boot_id():
                raise JobRunnerError(
                    f"attempt {attempt.attempt} of run {attempt.run_id} already runs "
                    f"(pid {old.pid}); reattach to it"
                )
        log_gid = attempt.account.gid if private else None
        log_mode = 0o640 if private else 0o600
        write = os.O_WRONLY | os.O_CREAT
        opened: list[int] = []
        try:
            # the spec holds the user's environment (her secrets): root's alone
            spec_fd = open_hub_file(
                os.path.join(attempt_dir, "spec.json"), write | os.O_TRUNC, 0o600, None
            )
            opened.append(spec_fd)
            os.write(spec_fd, json.dumps(spec).encode())
            os.close(opened.pop())
            spec_fd = os.open(os.path.join(attempt_dir, "spec.json"), os.O_RDONLY | os.O_CLOEXEC)
            opened.append(spec_fd)
            status_fd = open_hub_file(
                os.path.join(attempt_dir, "exit.json"), write | os.O_TRUNC, 0o600, None
            )
            opened.append(status_fd)
            for stream in STREAMS:
                log = os.path.join(attempt_dir, f"{stream}.log")
                opened.append(open_hub_file(log, write | os.O_APPEND, log_mode, log_gid))
            out_fd, err_fd = opened[-2:]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(attempt_dir, "ended-by"))
            started_at = time.time()
            started = self.sessions.spawn(
                [
                    self.python,
                    "-I",  # the job's PYTHONPATH and friends do not reach the wrapper
                    "-m",
                    WRAPPER_MODULE,
                    "run",
                    "--spec-fd",
                    str(spec_fd),
                    "--status-fd",
                    str(status_fd),
                ],
                account=attempt.account,
                groups=groups,
                env=self._environment(attempt),
                stdout=out_fd,
                stderr=err_fd,
                pass_fds=(spec_fd, status_fd),
                cwd="/",  # the wrapper enters the input's folder as the user, never the hub
            )
        finally:
            for fd in opened:
                os.close(fd)
        deadline = None if attempt.timeout_seconds is None else started_at + attempt.timeout_seconds
        handle = RunHandle(
            run_id=attempt.run_id,
            attempt=attempt.attempt,
            pid=started.pid,
            start_ticks=started.start_ticks,
            boot_id=started.boot_id,
            uid=attempt.account.uid,
            started_at=started_at,
            deadline=deadline,
            attempt_dir=attempt_dir,
            home=attempt.home,
            output_dir=os.path.join(attempt.output_dir, f"run-{attempt.run_id}"),
        )
        record = open_hub_file(
            os.path.join(attempt_dir, "handle.json"), write | os.O_TRUNC, 0o600, None
        )
        with os.fdopen(record, "w") as f:
            json.dump(handle.to_dict(), f)
        return handle

    async def start(self, attempt: RunAttempt) -> RunHandle:
        """Start ``attempt``; its handle (persist ``handle.to_dict()`` with the run).

        ``JobRunnerError`` when it cannot run (root, a hub that is not root, a second start of
        a running attempt). A job that cannot start in the user's account (the input is gone, its
        folder unreadable) starts and ends at once with exit code 126 or 127 and says why in its
        stderr log."""
        return await asyncio.to_thread(self._spawn, attempt)

    # -- wait, cancel, reattach ------------------------------------------------------------------

    def _running(self, handle: RunHandle) -> bool:
        """Whether the wrapper still runs (reaping it when it is this runner's child)."""
        return self.sessions.running(handle.pid, handle.start_ticks, handle.boot_id)

    def _mark(self, handle: RunHandle, why: str) -> None:
        """Record why the runner ends the attempt; the first reason stays (a cancel racing the
        timeout is reported as whichever came first)."""
        with contextlib.suppress(FileExistsError):
            fd = os.open(
                handle.ended_by_path,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            with os.fdopen(fd, "w") as f:
                f.write(why)

    async def _stop(self, handle: RunHandle, grace_seconds: float) -> None:
        """SIGTERM to every process of the attempt's session, SIGKILL to what is left after
        ``grace_seconds``; returns once none is left (``JobRunnerError`` if SIGKILL does not end
        them within ``KILL_WAIT_SECONDS``)."""
        what = f"run {handle.run_id} attempt {handle.attempt}"
        await self.sessions.stop(
            handle.pid, handle.start_ticks, handle.boot_id, grace_seconds, what
        )

    async def cancel(self, handle: RunHandle, grace_seconds: float = 10.0) -> None:
        """Stop the attempt: SIGTERM to its whole session, SIGKILL after ``grace_seconds``.
        Returns when every process of it is gone (its GPU share may be freed then); ``wait``
        reports it as canceled."""
        await asyncio.to_thread(self._mark, handle, "canceled")
        await self._stop(handle, grace_seconds)

    async def reattach(self, handle: RunHandle) -> RunHandle | None:
        """``handle`` when its process still runs (after a hub restart: a process that is not
        this runner's child), else None; ``wait(handle)`` returns the recorded result of an
        attempt that ended meanwhile."""
        return handle if await asyncio.to_thread(self._running, handle) else None

    async def wait(self, handle: RunHandle) -> RunResult:
        """Wait for the attempt to end and return how. Enforces the handle's deadline (a
        timed-out attempt is stopped like a cancel with the runner's ``grace_seconds``); once the
        wrapper is gone, stops what is left of its session, so that after ``wait`` no process of
        the attempt remains."""
        while await asyncio.to_thread(self._running, handle):
            if handle.deadline is not None and time.time() >= handle.deadline:
                await asyncio.to_thread(self._mark, handle, "timed_out")
                await self._stop(handle, self.grace_seconds)
                break
            await asyncio.sleep(self.poll_seconds)
        await self._stop(handle, self.straggler_grace_seconds)
        return await asyncio.to_thread(self._result, handle)

    def _result(self, handle: RunHandle) -> RunResult:
        ended_by = (read_small(handle.ended_by_path, 64) or b"").decode(errors="replace")
        # Trust: the status is written by the wrapper, a process of the job's owner, so the job
        # could forge it (ptrace its wrapper, or kill it and leave none). A forged status lies
        # about that one attempt only, as `exit 0` would: the file is per attempt, in a hub-owned
        # directory she cannot write, reached through a descriptor the hub opened for it alone.
        # Whether the runner canceled or timed it out comes from the hub's own marker, never
        # from this file; and the file is read as at most 4 KiB of JSON with two integer fields.
        status = parse_status(read_small(handle.status_path, MAX_STATUS_BYTES))
        rc = self.sessions.returncode(handle.pid, handle.start_ticks)
        self.sessions.forget(handle.pid, handle.start_ticks)
        platform_failure: str | None = None
        if status is not None:
            code, sig, before_job_code = status
            recorded = True
            if before_job_code:
                platform_failure = self._cause(handle) or "the job's runner reported no cause"
        elif rc is not None:
            code, sig = (rc, None) if rc >= 0 else (None, -rc)
            recorded = False
            if rc > 0:
                # the wrapper exited by itself without recording the job's end: it failed
                # (the job cannot make it exit, only kill it, which is a signal)
                platform_failure = f"the job's wrapper exited with code {rc} before recording it"
        else:
            code, sig, recorded = None, None, False
        return RunResult(
            exit_code=code,
            signal=sig,
            timed_out=ended_by == "timed_out",
            canceled=ended_by == "canceled",
            recorded=recorded,
            platform_failure=platform_failure,
        )

    @staticmethod
    def _cause(handle: RunHandle) -> str | None:
        """The wrapper's cause of a failure before the job's code, from its stderr log's end."""
        data, _ = LocalJobRunner._read_log(
            handle.log_path("stderr"),
            max(0, file_size(handle.log_path("stderr")) - CAUSE_TAIL_BYTES),
            CAUSE_TAIL_BYTES,
        )
        return platform_failure_cause(data)

    # -- logs and outputs ------------------------------------------------------------------------

    @staticmethod
    def _read_log(path: str, offset: int, limit: int) -> tuple[bytes, int]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return b"", offset
        try:
            size = os.fstat(fd).st_size
            if offset >= size:  # nothing new (or the job truncated its own log)
                return b"", offset
            data = os.pread(fd, min(limit, size - offset), offset)
            return data, offset + len(data)
        finally:
            os.close(fd)

    async def tail(
        self, handle: RunHandle, stream: Stream, offset: int = 0, limit: int = 1 << 20
    ) -> tuple[bytes, int]:
        """Up to ``limit`` bytes of the attempt's ``stream`` log from ``offset``, and the offset
        after them (the same offset when nothing is new)."""
        if offset < 0:
            raise ValueError(f"offset must be at least 0, got {offset}")
        return await asyncio.to_thread(self._read_log, handle.log_path(stream), offset, limit)

    async def list_outputs(self, handle: RunHandle) -> list[tuple[str, int]]:
        """(path relative to the run's output directory, size) of its files (``output_files``)."""
        return await asyncio.to_thread(output_files, handle.home, handle.output_dir, handle.uid)


class LocalJobExecutor:
    """The embedded default's `gpulab.hub.jobservice.JobExecutor`: attempts as processes of their
    owner's account, through `LocalJobRunner`.

    `workspace_for(owner)` gives the hub user's system account (making it where needed, as the
    local spawner does for servers) and the home a job's paths are relative to (her default
    server's, the folder JupyterLab shows); `gpu_of(uuid)` the inventory's GPU behind a
    placement's share (`GPUCapacity.gpu_by_uuid`), whose model and memory the job's GPU
    variables name.
    """

    def __init__(
        self,
        runner: LocalJobRunner,
        workspace_for: Callable[[str], Awaitable[tuple[SystemAccount, str]]],
        gpu_of: Callable[[str], Any],
        inventory_of: Callable[[str], str] = lambda node: "",
    ) -> None:
        self.runner, self.workspace_for, self.gpu_of = runner, workspace_for, gpu_of
        #: how a node knows its GPUs ('declared', 'simulated' or ''), so that a run's GPU report
        #: simulates the devices nothing can measure, as a server's monitor does
        self.inventory_of = inventory_of

    def placement_environment(self, placement: Placement) -> dict[str, str]:
        """The GPU variables of a placement, as a server on it gets them."""
        env, _enforcement = gpu_environment(assigned_gpus(placement.gpus, self.gpu_of))
        if placement.gpus:
            env.update(inventory_environment(self.inventory_of(placement.node)))
        return env

    async def start(
        self,
        run: Run,
        spec: JobSpec,
        placement: Placement,
        report: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        account, home = await self.workspace_for(spec.owner)
        attempt = RunAttempt.from_spec(
            spec,
            run_id=run.id,
            attempt=len(run.attempts),
            account=account,
            placement_environment=self.placement_environment(placement),
            home=home,
            report=report,
        )
        return (await self.runner.start(attempt)).to_dict()

    async def wait(self, handle: Mapping[str, Any]) -> RunResult:
        return await self.runner.wait(RunHandle.from_dict(handle))

    async def cancel(self, handle: Mapping[str, Any]) -> None:
        await self.runner.cancel(RunHandle.from_dict(handle))

    async def reattach(self, handle: Mapping[str, Any]) -> bool:
        return await self.runner.reattach(RunHandle.from_dict(handle)) is not None

    async def tail(
        self, handle: Mapping[str, Any], stream: str, offset: int = 0
    ) -> tuple[bytes, int]:
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {', '.join(STREAMS)}, got {stream!r:.40}")
        return await self.runner.tail(RunHandle.from_dict(handle), stream, offset)

    async def outputs(self, handle: Mapping[str, Any]) -> list[tuple[str, int]]:
        return await self.runner.list_outputs(RunHandle.from_dict(handle))
