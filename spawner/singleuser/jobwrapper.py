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
   and exits with the job's code (128 + the signal for a signalled job);
5. with ``--list-outputs``, before it exits, prints one line to stderr::

       gpulab job: outputs {"files": [["model.bin", 10], ...], "more": false}

   the regular files under the run's output directory (the first of the spec's ``make_dirs``)
   with their sizes, sorted, at most ``MAX_LISTED_OUTPUTS``, without following symlinks. The hub
   takes the last such line of the pod's log as the attempt's outputs. The job could print a
   forged one: it lies about its own run's listing only (files she controls anyway, as locally).

``notebook`` is the job of a notebook run: papermill executes the input with JSON-typed
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
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from gpulab.spawner.names import REPORT_SPEC_KEY

#: exit codes of an attempt whose job could not be started (the shell's conventions)
CANNOT_EXECUTE = 126
NOT_FOUND = 127

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


def _say(message: str) -> None:
    print(f"gpulab job: {message}", file=sys.stderr, flush=True)


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
        _say(f"cannot prepare the run: {e.strerror}: {e.filename}")
        _write_status(status_fd, {"exit_code": CANNOT_EXECUTE})
        return CANNOT_EXECUTE
    forward = _Forward() if forward_signals else None
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward or _ignore)
    try:
        # forwarding: the job leads a group of its own, which the wrapper signals (never itself)
        child = subprocess.Popen(spec["argv"], start_new_session=forward is not None)
    except OSError as e:
        code = NOT_FOUND if isinstance(e, FileNotFoundError) else CANNOT_EXECUTE
        _say(f"cannot start {spec['argv'][0]}: {e.strerror}")
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
        _say(f"GPU figures not reported: jupyterlab_gpulab is not installed here ({e})")
        return None
    reporter = reporter_from_mapping({str(k): str(v) for k, v in report.items()})
    if reporter is not None:
        reporter.start_in_thread()
    return reporter


# -- notebooks ---------------------------------------------------------------------------------


def _first_line(source: str, width: int = 60) -> str:
    line = next((s.strip() for s in source.splitlines() if s.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


#: what the kernel runs first, hidden from the output notebook: gpulab's checkpoint extension,
#: which saves the kernel's variables on SIGTERM (and, resuming, restores them at load)
CHECKPOINT_EXTENSION = "gpulab.spawner.singleuser.checkpoint.kernel"
#: in the run's checkpoint directory, next to the kernel's checkpoint: the last code cell whose
#: effects that checkpoint holds (written only after the kernel saved on SIGTERM)
PROGRESS_FILE = "notebook-progress.json"
#: the tag of that hidden cell
HIDDEN_TAG = "gpulab-checkpoint-extension"
#: the kernel's checkpoint slot under the run's checkpoint directory (one notebook per run)
KERNEL_SLOT = "notebook"


class _NotebookProgress:
    """Which code cells ran, by their index in the parameterized notebook, and the progress
    lines (``[cell k/N] ...``) a log reader sees. Cells are known by identity: the engine inserts
    a hidden cell and stands raw cells in for skipped ones, which moves indices."""

    def __init__(self, cells: list[Any], skip_through: int) -> None:
        code = [i for i, cell in enumerate(cells) if cell.get("cell_type") == "code"]
        self.total = len(code)
        self.number = {id(cells[i]): n for n, i in enumerate(code, start=1)}
        self.index = {id(cells[i]): i for i in code}
        self.completed = skip_through  # the last code cell whose effects the kernel holds
        self._started: dict[int, float] = {}
        self._failed: set[int] = set()

    def hook(self, nb_man: Any) -> None:
        cell_start, cell_exception, cell_complete = (
            nb_man.cell_start,
            nb_man.cell_exception,
            nb_man.cell_complete,
        )

        def on_start(cell: Any, cell_index: int | None = None, **kw: Any) -> Any:
            if id(cell) in self.number:
                self._started[id(cell)] = time.monotonic()
                self._line(cell, _first_line(cell.get("source", "")) or "(empty)")
            return cell_start(cell, cell_index, **kw)

        def on_exception(cell: Any, cell_index: int | None = None, **kw: Any) -> Any:
            self._failed.add(id(cell))
            return cell_exception(cell, cell_index, **kw)

        def on_complete(cell: Any, cell_index: int | None = None, **kw: Any) -> Any:
            if id(cell) in self._started:
                took = time.monotonic() - self._started.pop(id(cell))
                failed = id(cell) in self._failed
                self._line(cell, f"{'failed after' if failed else 'done in'} {took:.1f} s")
                if not failed:
                    self.completed = max(self.completed, self.index[id(cell)])
            return cell_complete(cell, cell_index, **kw)

        nb_man.cell_start, nb_man.cell_exception, nb_man.cell_complete = (
            on_start,
            on_exception,
            on_complete,
        )

    def _line(self, cell: Any, text: str) -> None:
        print(f"[cell {self.number[id(cell)]}/{self.total}] {text}", flush=True)


def _read_progress(checkpoint_dir: str | None) -> int:
    """The last code cell a previous attempt's checkpoint holds (-1: start afresh). The record is
    taken (removed): if this attempt is killed before it saves again, the next one starts afresh
    rather than resuming from a record that no longer matches the checkpoint."""
    if not checkpoint_dir:
        return -1
    path = os.path.join(checkpoint_dir, PROGRESS_FILE)
    try:
        with open(path) as f:
            completed = json.load(f)["completed"]
        os.unlink(path)
    except (OSError, ValueError, KeyError, TypeError):
        return -1
    return completed if isinstance(completed, int) else -1


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); None when the
    process is gone. The name may hold spaces and parentheses: split after the last ')'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _kernel_children() -> list[int]:
    """This process's children: the kernel papermill started (in a session of its own, which a
    signal to the attempt's session does not reach)."""
    me = str(os.getpid())
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and (fields := _stat(entry)) is not None and fields[1] == me
    ]


def _stop_saving(progress: _NotebookProgress, checkpoint_dir: str | None, grace: float) -> None:
    """SIGTERM (a cancel, a preemption, a node drain): the kernel saves its variables (its
    checkpoint extension's SIGTERM handler) and exits; once it has, record which cells that
    checkpoint holds, so that the next attempt restores it and goes on from the next cell. A
    cell that was running reruns then, over the variables as it left them."""
    kernels = _kernel_children()
    for pid in kernels:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    # until reaped, not merely exited: a zombie left at our exit would go to an init that may
    # never reap it, and it would still count as the attempt's process
    while time.monotonic() < deadline and any(_stat(p) is not None for p in kernels):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)
        time.sleep(0.05)
    saved = kernels and not any(_alive(p) for p in kernels)
    if saved and checkpoint_dir and progress.completed >= 0:
        with contextlib.suppress(OSError):
            tmp = os.path.join(checkpoint_dir, PROGRESS_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump({"completed": progress.completed}, f)
            os.replace(tmp, os.path.join(checkpoint_dir, PROGRESS_FILE))
            _say(f"stopped: the kernel's checkpoint holds cells through {progress.completed}")


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _stand_in(cell: Any, like: Any) -> Any:
    """`cell` with the execution record papermill keeps on every cell (it sets it up before the
    engine runs, and its hooks write to it)."""
    record = like.get("metadata", {}).get("papermill")
    if record is not None:
        cell.metadata["papermill"] = {
            k: None for k in ("exception", "start_time", "end_time", "duration")
        } | {"status": "pending"}
    return cell


def _is_python(nb: Any, kernel_name: str) -> bool:
    language = (nb.metadata.get("kernelspec") or {}).get("language") or (
        nb.metadata.get("language_info") or {}
    ).get("name")
    return "python" in (language or kernel_name).lower()


def run_notebook(
    input_path: str,
    output_path: str,
    parameters_file: str,
    kernel: str,
    stop_grace_seconds: float = 8.0,
) -> int:
    """Execute a notebook with papermill; 0 when every cell ran, 1 when one raised. Resumes from
    the kernel checkpoint a stopped attempt of the same run left (``GPULAB_CHECKPOINT_DIR``)."""
    import nbformat as untyped_nbformat
    import papermill
    from papermill.engines import NBClientEngine, papermill_engines
    from papermill.exceptions import PapermillExecutionError

    from gpulab.spawner.names import AUTO_RESTORE_ENV, CHECKPOINT_DIR_ENV, CHECKPOINT_SLOT_ENV

    nbformat: Any = untyped_nbformat  # no type hints of its own

    checkpoint_dir = os.environ.get(CHECKPOINT_DIR_ENV) or None
    resume_through = _read_progress(checkpoint_dir)
    os.environ[CHECKPOINT_SLOT_ENV] = KERNEL_SLOT  # the kernel inherits these
    if resume_through >= 0:
        os.environ[AUTO_RESTORE_ENV] = "1"
    else:
        os.environ.pop(AUTO_RESTORE_ENV, None)
    previous = None
    if resume_through >= 0 and os.path.exists(output_path):
        with contextlib.suppress(Exception):  # outputs to show again; the run goes on without
            previous = nbformat.read(output_path, as_version=4)
            previous.cells = [
                c for c in previous.cells if HIDDEN_TAG not in c.get("metadata", {}).get("tags", [])
            ]
    state: dict[str, _NotebookProgress] = {}

    def on_sigterm(signum: int, frame: object) -> None:
        progress = state.get("progress")
        if progress is not None:
            _stop_saving(progress, checkpoint_dir, stop_grace_seconds)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)

    class ProgressEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, **kw: Any) -> Any:
            cells = nb_man.nb.cells
            progress = _NotebookProgress(list(cells), resume_through)
            progress.hook(nb_man)
            skipped = {}
            for i, cell in enumerate(list(cells)):
                if cell.get("cell_type") == "code" and i <= resume_through:
                    skipped[i] = cell
                    cells[i] = _stand_in(nbformat.v4.new_raw_cell(""), cell)
            if skipped:
                print(
                    f"[resume] {len(skipped)} of {progress.total} code cells restored from the "
                    "checkpoint of the stopped attempt",
                    flush=True,
                )
            hidden = None
            if _is_python(nb_man.nb, kernel_name):
                # a kernel without gpulab (another environment) runs on, without checkpoints
                hidden = nbformat.v4.new_code_cell(
                    "try:\n"
                    f"    get_ipython().run_line_magic('load_ext', {CHECKPOINT_EXTENSION!r})\n"
                    "except Exception as e:\n"
                    "    print('gpulab: no kernel checkpoints in this job:', e)"
                )
                _stand_in(hidden, cells[0])
                # tagged: papermill saves the notebook after each cell, with this cell in it, and
                # a stopped attempt leaves it so
                hidden.metadata["tags"] = [HIDDEN_TAG]
                cells.insert(0, hidden)
            state["progress"] = progress
            try:
                return super().execute_managed_notebook(nb_man, kernel_name, **kw)
            finally:
                if hidden is not None:
                    del cells[next(i for i, c in enumerate(cells) if c is hidden)]
                for i, cell in skipped.items():
                    if previous is not None and i < len(previous.cells):
                        cell["outputs"] = previous.cells[i].get("outputs", [])
                        cell["execution_count"] = previous.cells[i].get("execution_count")
                    cell.setdefault("metadata", {})["gpulab"] = {"restored_from_checkpoint": True}
                    cells[i] = cell

    papermill_engines.register("gpulab-progress", ProgressEngine)
    with open(parameters_file) as f:
        parameters = json.load(f)
    try:
        papermill.execute_notebook(
            input_path,
            output_path,
            parameters=parameters,
            kernel_name=kernel,
            engine_name="gpulab-progress",
            progress_bar=False,
            log_output=False,
            stdout_file=sys.stdout,
            stderr_file=sys.stderr,
        )
    except PapermillExecutionError as e:
        _say(f"cell {e.exec_count} raised {e.ename}: {e.evalue} (see {output_path})")
        return 1
    return 0


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
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_wrapper(
            args.spec_fd,
            args.status_fd,
            spec_file=args.spec_file,
            forward_signals=args.forward_signals,
            list_outputs_after=args.list_outputs,
        )
    return run_notebook(args.input, args.output, args.parameters_file, args.kernel)


if __name__ == "__main__":
    sys.exit(main())
