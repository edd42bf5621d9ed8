"""What the local job runner (``gpulab.spawner.local.jobs``) knows of an attempt, as values: the
attempt to start (``RunAttempt``), the handle of a started one that the hub persists
(``RunHandle``), how one ended (``RunResult``, from the wrapper's status file), and the run's
output files read without following anything its owner controls (``output_files``).
"""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal

from gpulab.hub.jobs.model import (
    Cancel,
    Event,
    Fail,
    JobKind,
    JobSpec,
    JSONValue,
    Succeed,
    TimeOut,
    check_relative_path,
)
from gpulab.spawner.job_attempt import (
    run_checkpoint_dir,
    run_output_dir,
)
from gpulab.spawner.local.accounts import SystemAccount
from gpulab.spawner.local.processes import (
    ProcessError,
)

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, ...] = ("stdout", "stderr")

#: the status file holds one small JSON object; anything longer is not the wrapper's
MAX_STATUS_BYTES = 4096
#: the end of the stderr log read for the cause of a failure before the job's code started
CAUSE_TAIL_BYTES = 64 * 1024


class JobRunnerError(ProcessError):
    """An attempt could not be started or stopped; the message says why and what to change."""


@dataclass(frozen=True)
class RunAttempt:
    """One attempt of a run, as the job service hands it to the runner.

    ``path`` and ``output_dir`` are relative to ``home`` (the owner's home; by default the
    account's passwd home) and were validated by ``JobSpec``; they are checked again here.
    ``environment`` is the user's (validated: no reserved names), ``placement_environment`` the
    GPU variables of the attempt's placement (``gpulab.spawner.environment.gpu_environment``).
    """

    run_id: int
    attempt: int
    account: SystemAccount
    kind: JobKind
    path: str
    output_dir: str
    parameters: Mapping[str, JSONValue] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    environment: Mapping[str, str] = field(default_factory=dict)
    placement_environment: Mapping[str, str] = field(default_factory=dict)
    timeout_seconds: int | None = None
    home: str = ""
    kernel_name: str = "python3"
    #: the attempt's GPU report (REPORT_*_ENV), for the wrapper's spec only
    report: Mapping[str, str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.account.uid == 0 or self.account.gid == 0:
            raise JobRunnerError(
                f"refusing to run a job as root (account {self.account.name!r}, "
                f"uid {self.account.uid}, gid {self.account.gid}): jobs run as their owner's "
                "unprivileged account"
            )
        if self.run_id < 1 or self.attempt < 1:
            raise JobRunnerError(
                f"run id and attempt count from 1, got {self.run_id}, {self.attempt}"
            )
        if self.kind not in ("notebook", "script"):
            raise JobRunnerError(f"kind must be 'notebook' or 'script', got {self.kind!r:.40}")
        check_relative_path("path", self.path)
        check_relative_path("output_dir", self.output_dir)
        if self.timeout_seconds is not None and self.timeout_seconds < 1:
            raise JobRunnerError(f"timeout_seconds must be at least 1, got {self.timeout_seconds}")
        home = self.home or self.account.home
        if not os.path.isabs(home):
            raise JobRunnerError(f"the owner's home must be an absolute path, got {home!r:.80}")
        object.__setattr__(self, "home", os.path.normpath(home))
        object.__setattr__(self, "parameters", MappingProxyType(dict(self.parameters)))
        object.__setattr__(self, "environment", MappingProxyType(dict(self.environment)))
        object.__setattr__(
            self, "placement_environment", MappingProxyType(dict(self.placement_environment))
        )

    @classmethod
    def from_spec(
        cls,
        spec: JobSpec,
        *,
        run_id: int,
        attempt: int,
        account: SystemAccount,
        placement_environment: Mapping[str, str],
        home: str = "",
        report: Mapping[str, str] | None = None,
    ) -> RunAttempt:
        """The attempt of a run of ``spec``."""
        return cls(
            run_id=run_id,
            attempt=attempt,
            account=account,
            kind=spec.kind,
            path=spec.path,
            output_dir=spec.output_dir,
            parameters=spec.parameters,
            args=spec.args,
            environment=spec.environment,
            placement_environment=placement_environment,
            timeout_seconds=spec.timeout_seconds,
            home=home,
            report=report,
        )

    @property
    def run_output_dir(self) -> str:
        """``<home>/<output_dir>/run-<id>``: the run's outputs, the same for every attempt."""
        return run_output_dir(self.home, self.output_dir, self.run_id)

    @property
    def checkpoint_dir(self) -> str:
        """``GPULAB_CHECKPOINT_DIR``: kept across attempts, so that a retry resumes from it."""
        return run_checkpoint_dir(self.home, self.output_dir, self.run_id)


@dataclass(frozen=True)
class RunHandle:
    """A started attempt, as plain values the hub persists (``to_dict``/``from_dict``).

    ``pid`` is the wrapper's, which leads the attempt's session and process group; ``start_ticks``
    (field 22 of /proc/<pid>/stat) and ``boot_id`` tell it from a later process that got the same
    pid. ``deadline`` (seconds since the epoch, None: no limit) survives a hub restart, so a
    reattached wait still enforces the timeout.
    """

    run_id: int
    attempt: int
    pid: int
    start_ticks: int
    boot_id: str
    uid: int
    started_at: float
    deadline: float | None
    attempt_dir: str  # hub-owned: logs, status, record of what was started
    home: str
    output_dir: str  # relative to home: <JobSpec.output_dir>/run-<id>

    def log_path(self, stream: Stream) -> str:
        if stream not in STREAMS:
            raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r:.40}")
        return os.path.join(self.attempt_dir, f"{stream}.log")

    @property
    def status_path(self) -> str:
        return os.path.join(self.attempt_dir, "exit.json")

    @property
    def ended_by_path(self) -> str:
        return os.path.join(self.attempt_dir, "ended-by")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunHandle:
        names = {f.name for f in fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"a run handle needs {', '.join(sorted(missing))}")
        return cls(**{k: data[k] for k in names})


@dataclass(frozen=True)
class RunResult:
    """How an attempt ended. ``recorded``: the wrapper wrote the exit status (False when it was
    killed itself, by a cancel's SIGKILL or by someone else); ``exit_code``/``signal`` are then
    the wrapper's own where the runner saw it end, else None."""

    exit_code: int | None
    signal: int | None
    timed_out: bool = False
    canceled: bool = False
    recorded: bool = True
    #: why it failed before the job's own code started (the wrapper's report, or its own end
    #: without one), None when it did not: the platform's failure, retried without counting
    platform_failure: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.canceled)

    @property
    def reason(self) -> str:
        """For people: '', 'exit code 3', 'killed by SIGKILL', 'canceled', 'timed out'."""
        if self.canceled:
            return "canceled"
        if self.timed_out:
            return "timed out"
        if self.platform_failure is not None:
            return f"failed before the job's code started: {self.platform_failure}"
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        if self.exit_code is None:
            return "ended without an exit status (its wrapper was killed)"
        return "" if self.exit_code == 0 else f"exit code {self.exit_code}"

    def event(self, at: float) -> Event:
        """The jobs core's event for this ending (``transition(run, result.event(now))``)."""
        if self.canceled:
            return Cancel(at)
        if self.timed_out:
            return TimeOut(at)
        if self.succeeded:
            return Succeed(at)
        return Fail(
            at,
            reason=self.reason,
            exit_code=self.exit_code,
            platform_failure=self.platform_failure is not None,
        )


# -- files ---------------------------------------------------------------------------------------


def parse_status(raw: bytes | None) -> tuple[int | None, int | None, bool] | None:
    """(exit code, signal, failed before the job's code started) from the wrapper's status
    file, or None when there is none or it is not what the wrapper writes."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    code, sig = data.get("exit_code"), data.get("signal")
    platform = data.get("platform_failure", False) is True
    if isinstance(code, int) and not isinstance(code, bool) and sig is None and 0 <= code < 256:
        return code, None, platform and code != 0
    if isinstance(sig, int) and not isinstance(sig, bool) and code is None and 0 < sig < 128:
        return None, sig, False
    return None


def output_files(
    home: str, output_dir: str, uid: int, limit: int = 10_000
) -> list[tuple[str, int]]:
    """(path relative to the output directory, size) of the regular files the account ``uid``
    owns under ``home/output_dir``, sorted, at most ``limit`` of them.

    The hub reads a tree its user controls, so nothing in it is followed: every directory is
    opened relative to its parent with O_NOFOLLOW (a symlinked component ends the listing), the
    walk is ``os.fwalk`` over directory descriptors, and a file someone else owns (a hard link
    to another account's file) is left out."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        fd = os.open(home, flags)
    except OSError:
        return []
    try:
        for part in check_relative_path("output_dir", output_dir).split("/"):
            try:
                child = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                return []
            os.close(fd)
            fd = child
        found: list[tuple[str, int]] = []
        for top, _dirs, files, top_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in files:
                try:
                    st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                    found.append((os.path.normpath(os.path.join(top, name)), st.st_size))
                    if len(found) >= limit:
                        return sorted(found)
        return sorted(found)
    finally:
        os.close(fd)


def file_size(path: str) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return 0
