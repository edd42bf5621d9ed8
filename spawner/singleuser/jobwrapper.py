"""The process a job attempt starts as, under the job owner's account: it runs the job, waits for
it, and records how it ended.

The local job runner (``gpulab.spawner.local.jobs``, in the hub) starts this module as the owner's
uid, in a new session, with stdout and stderr on the attempt's log files and two descriptors of
the hub's: ``--spec-fd`` (what to run, JSON) and ``--status-fd`` (a hub-owned file it cannot open
by name, where it writes the exit status once). On Kubernetes (``gpulab.spawner.kube.job_objects``)
it is the container's command: ``--spec-file`` names the spec in the attempt's Secret volume,
there is no status descriptor (the container's exit code, in the pod's status, is the record),
``--forward-signals`` passes the SIGTERM the kubelet sends to the container's first process
(this wrapper) on to the job's process group, which no hub signals there, and ``--list-outputs``
ends the log with the run's outputs (step 5), since the hub cannot read the pod's volume. It

1. creates the run's output and checkpoint directories (0700, as the owner: the hub never creates
   or follows paths inside a user's home as root) and, for a notebook, its ``parameters.json``;
2. enters the input's folder and starts the job as its own child, in the same session and process
   group, so that one signal to the group reaches both;
3. lets SIGTERM, SIGINT and SIGHUP pass it by (a Python handler that does nothing, reset to the
   default in the job by exec) so that it outlives the job and records "killed by SIGTERM";
4. writes ``{"exit_code": n}`` or ``{"signal": n}`` to the status descriptor (when it has one)
   and exits with the job's code (128 + the signal for a signalled job); an attempt that failed
   before the job's own code started is told apart (below);
5. with ``--list-outputs``, before it exits, prints one line to stderr::

       gpulab job: outputs {"files": [["model.bin", 10], ...], "more": false}

   the regular files under the run's output directory (the first of the spec's ``make_dirs``)
   with their sizes, sorted, at most ``MAX_LISTED_OUTPUTS``, without following symlinks. The hub
   takes the last such line of the pod's log as the attempt's outputs. The job could print a
   forged one: it lies about its own run's listing only (files she controls anyway, as locally).

Failed before the job's code started. Some attempts fail where the job did nothing wrong: the
notebook's kernel does not start within ``--kernel-start-timeout`` (nbclient's start-up wait;
under load a kernel took longer than its 60 s default), the kernel dies before the first of the
job's cells, or the job's process cannot be forked (EAGAIN, ENOMEM). The wrapper then prints one
stderr line::

    gpulab job: failed before the job's code started: the kernel did not start: ...

exits with ``BEFORE_USER_CODE`` (75, sysexits' EX_TEMPFAIL) and writes
``{"exit_code": 75, "platform_failure": true}`` to the status descriptor. The hub retries such
an attempt without counting it against the run's ``max_retries`` (``gpulab.hub.jobs.runs``) and
shows the line's cause as the attempt's reason (``platform_failure_cause``). A notebook's runner
(``notebook`` below, gpulab's own code) reports its kernel's start this way; a script's exit
code is the script's own, so a script that exits 75 has failed by itself. On Kubernetes the exit
code and the line are the record (no status descriptor): the job could print the line itself,
which lies only about its own run, for at most the few retries a run's platform failures get.

``notebook`` (``notebook_job``) is the job of a notebook run: papermill executes the input with JSON-typed
parameters (its ``parameters`` cell convention) into the output notebook, the cells' stdout and
stderr going to the process's own, with one progress line per code cell on stdout::

    [cell 3/10] model.fit(x, y, epochs=3)
    [cell 3/10] done in 41.2 s

A notebook job resumes where a stopped attempt left it (a preemption, a node drain, a cancel):
its kernel loads gpulab's checkpoint extension (a hidden first cell), which saves the kernel's
variables into the run's ``GPULAB_CHECKPOINT_DIR`` when the wrapper passes it the SIGTERM that
stopped the attempt (the kernel runs in a session of its own, which a signal to the attempt's
session does not reach); once it has, the wrapper records the last code cell that completed. The
next attempt restores those variables and runs on from the next cell; the cells it skips keep
their outputs from the stopped attempt and say ``"gpulab": {"restored_from_checkpoint": true}``
in their metadata. A cell that was running when the attempt stopped runs again, over the
variables as it left them. An attempt killed without that SIGTERM (SIGKILL, a lost node) leaves
no record, and the next one starts from the first cell.

It calls papermill's Python API rather than its command line: the CLI reads ``-y`` parameters as
YAML 1.1, which turns JSON values such as ``1e+20`` into strings, and it has no per-cell progress
lines (only a tqdm bar or its log of every output).

Standard library only, but for papermill in ``notebook`` (and the shared names): this runs in the
user's account with nothing of the hub's.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from gpulab.spawner.names import REPORT_SPEC_KEY

#: exit codes of an attempt whose job could not be started (the shell's conventions)
CANNOT_EXECUTE = 126
NOT_FOUND = 127
#: the exit code of an attempt that failed before the job's own code started (sysexits.h's
#: EX_TEMPFAIL: a temporary failure, worth trying again)
BEFORE_USER_CODE = 75
#: the stderr line that says so, and why (after the prefix)
PLATFORM_FAILURE_PREFIX = "gpulab job: failed before the job's code started: "
#: the spec's key for a job whose runner is gpulab's own (a notebook's): its BEFORE_USER_CODE
#: exit is the runner's report, not the job's
RUNNER_REPORTS_START_KEY = "runner_reports_start"
#: the kernel's start-up wait when the hub names none (nbclient's own default)
DEFAULT_KERNEL_START_TIMEOUT_SECONDS = 60  # whole seconds: nbclient's startup_timeout is an int
#: errors of fork/exec that say the machine was short of something, not that the job is wrong
_PLATFORM_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM})

#: the outputs line of ``--list-outputs`` (its prefix, after which the JSON follows)
OUTPUTS_PREFIX = "gpulab job: outputs "
#: at most this many files are listed (the line stays one pod-log line of a bounded size)
MAX_LISTED_OUTPUTS = 1000
#: the GPU report's last push may hold the wrapper's end up this long (then it is given up)
REPORT_STOP_SECONDS = 5.0


def _ignore(signum: int, frame: object) -> None:
    """The wrapper outlives SIGTERM/SIGINT/SIGHUP sent to its group; the job gets them."""


class _Forward:
    """Passes SIGTERM/SIGINT/SIGHUP on to the job's own process group (``--forward-signals``):
    where only the wrapper is signalled (a container's first process), the job still gets them.
    A signal that comes before the job started is passed on once it has."""

    def __init__(self) -> None:
        self.group: int | None = None
        self.pending: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        if self.group is None:
            self.pending.append(signum)
            return
        # the job may be gone already; the wrapper is about to record it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.group, signum)

    def started(self, pid: int) -> None:
        self.group = pid
        for signum in self.pending:
            self(signum, None)
        self.pending.clear()


def _write_status(fd: int | None, status: dict[str, int]) -> None:
    # one small write to a file only this process holds open for writing; the hub reads it only
    # after this process is gone, so it never sees half of it
    if fd is None:
        return  # on Kubernetes the container's exit code is the record
    os.write(fd, json.dumps(status).encode() + b"\n")
    os.fsync(fd)
    os.close(fd)


def say(message: str) -> None:
    print(f"gpulab job: {message}", file=sys.stderr, flush=True)


def say_platform_failure(cause: str) -> None:
    # one line whatever the cause holds: the hub reads the last such line of the log
    line = " ".join(cause.split())[:300]
    print(PLATFORM_FAILURE_PREFIX + line, file=sys.stderr, flush=True)


def platform_failure_cause(log: bytes) -> str | None:
    """The cause on the last ``PLATFORM_FAILURE_PREFIX`` line of an attempt's log (its end is
    enough), or None when the log has none."""
    marker = PLATFORM_FAILURE_PREFIX.encode()
    at = log.rfind(b"\n" + marker)
    if at < 0:
        if not log.startswith(marker):
            return None
        at = -1
    line = log[at + 1 + len(marker) :].split(b"\n", 1)[0]
    return line.decode(errors="replace").strip() or "no cause given"


def list_outputs(directory: str, limit: int = MAX_LISTED_OUTPUTS) -> tuple[list[list[Any]], bool]:
    """[relative path, size] of the regular files under ``directory`` (symlinks are neither
    followed nor listed), sorted, at most ``limit``; and whether more were left out."""
    found: list[list[Any]] = []
    more = False
    for top, dirs, files in os.walk(directory, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if len(found) >= limit:
                more = True
                break
            found.append([os.path.relpath(path, directory), st.st_size])
    return sorted(found), more


def _print_outputs(directory: str) -> None:
    files, more = list_outputs(directory)
    listing = json.dumps({"files": files, "more": more}, separators=(",", ":"))
    print(OUTPUTS_PREFIX + listing, file=sys.stderr, flush=True)


def _read_spec(spec_fd: int | None, spec_file: str | None) -> dict[str, Any]:
    if spec_file is not None:
        with open(spec_file, "rb") as f:
            data: dict[str, Any] = json.loads(f.read())
        return data
    assert spec_fd is not None
    with os.fdopen(spec_fd, "rb") as f:
        data = json.loads(f.read())
    return data


def run_wrapper(
    spec_fd: int | None = None,
    status_fd: int | None = None,
    *,
    spec_file: str | None = None,
    forward_signals: bool = False,
    list_outputs_after: bool = False,
) -> int:
    """Run the job the spec describes (from ``spec_fd`` or ``spec_file``); record its exit status
    to ``status_fd`` when given, and return it (``list_outputs_after``: step 5 of the module
    docstring, whatever the job's end)."""
    spec = _read_spec(spec_fd, spec_file)
    code = _run(spec, status_fd, forward_signals)
    if list_outputs_after and spec.get("make_dirs"):
        _print_outputs(spec["make_dirs"][0])
    return code


def _run(spec: dict[str, Any], status_fd: int | None, forward_signals: bool) -> int:
    if status_fd is not None:
        os.set_inheritable(status_fd, False)  # the job never holds the status file
    try:
        for directory in spec["make_dirs"]:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        if spec.get("parameters_file"):
            fd = os.open(spec["parameters_file"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(spec["parameters"], out, indent=1)
        os.chdir(spec["cwd"])
    except OSError as e:
        say(f"cannot prepare the run: {e.strerror}: {e.filename}")
        _write_status(status_fd, {"exit_code": CANNOT_EXECUTE})
        return CANNOT_EXECUTE
    forward = _Forward() if forward_signals else None
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward or _ignore)
    try:
        # forwarding: the job leads a group of its own, which the wrapper signals (never itself)
        child = subprocess.Popen(spec["argv"], start_new_session=forward is not None)
    except OSError as e:
        if e.errno in _PLATFORM_ERRNOS:  # the machine was short of processes or memory
            say_platform_failure(f"cannot start {spec['argv'][0]}: {e.strerror}")
            _write_status(status_fd, {"exit_code": BEFORE_USER_CODE, "platform_failure": True})
            return BEFORE_USER_CODE
        code = NOT_FOUND if isinstance(e, FileNotFoundError) else CANNOT_EXECUTE
        say(f"cannot start {spec['argv'][0]}: {e.strerror}")
        _write_status(status_fd, {"exit_code": code})
        return code
    if forward is not None:
        forward.started(child.pid)
    reporter = _start_report(spec.get(REPORT_SPEC_KEY))
    code = child.wait()  # retried after each ignored signal (PEP 475)
    if reporter is not None:  # the last stretch is pushed while the share is still held
        reporter.stop_thread(timeout=REPORT_STOP_SECONDS)
    if code < 0:
        _write_status(status_fd, {"signal": -code})
        return 128 - code
    if code == BEFORE_USER_CODE and spec.get(RUNNER_REPORTS_START_KEY):
        # gpulab's notebook runner said so (and printed why): the kernel never ran her cells
        _write_status(status_fd, {"exit_code": code, "platform_failure": True})
        return code
    _write_status(status_fd, {"exit_code": code})
    return code


def _start_report(report: Any) -> Any:
    """The run's GPU report (the spec's REPORT_SPEC_KEY, which the hub fills where it runs
    gpulab-metrics), pushed from a thread of this wrapper by jupyterlab_gpulab's reporter, so the
    run's GPU-hours are measured like a server's. The token stays in this process: the job's
    environment never has it. Without jupyterlab_gpulab in the run's environment the run goes on
    unreported, and says so once."""
    if not isinstance(report, dict) or not report:
        return None
    try:
        from jupyterlab_gpulab.reporter import reporter_from_mapping
    except ImportError as e:
        say(f"GPU figures not reported: jupyterlab_gpulab is not installed here ({e})")
        return None
    reporter = reporter_from_mapping({str(k): str(v) for k, v in report.items()})
    if reporter is not None:
        reporter.start_in_thread()
    return reporter


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpulab.spawner.singleuser.jobwrapper")
    sub = parser.add_subparsers(dest="command", required=True)
    wrap = sub.add_parser("run", help="run a job attempt and record its exit status")
    source = wrap.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec-fd", type=int, help="read the spec from this descriptor (local)")
    source.add_argument("--spec-file", help="read the spec from this file (a Secret volume)")
    wrap.add_argument(
        "--status-fd", type=int, help="write the exit status here; none: the exit code only"
    )
    wrap.add_argument(
        "--forward-signals",
        action="store_true",
        help="pass SIGTERM/SIGINT/SIGHUP on to the job (where only the wrapper is signalled)",
    )
    wrap.add_argument(
        "--list-outputs",
        action="store_true",
        help="end with one stderr line listing the files of the run's output directory",
    )
    nb = sub.add_parser("notebook", help="execute a notebook with papermill, with progress lines")
    nb.add_argument("input")
    nb.add_argument("output")
    nb.add_argument("--parameters-file", required=True)
    nb.add_argument("--kernel", default="python3")
    nb.add_argument(
        "--kernel-start-timeout",
        type=int,
        default=DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
        help="how long the kernel may take to start, in seconds (then: failed before the job's code)",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_wrapper(
            args.spec_fd,
            args.status_fd,
            spec_file=args.spec_file,
            forward_signals=args.forward_signals,
            list_outputs_after=args.list_outputs,
        )
    # the notebook's runner imports this module's exit codes: imported once a notebook runs, so
    # that neither module needs the other to load (and a script's wrapper loads no papermill)
    from gpulab.spawner.singleuser.notebook_job import run_notebook

    return run_notebook(
        args.input,
        args.output,
        args.parameters_file,
        args.kernel,
        kernel_start_timeout_seconds=args.kernel_start_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
