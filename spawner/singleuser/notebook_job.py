"""The job of a notebook run (``python -m gpulab.spawner.singleuser.jobwrapper notebook``):
papermill executes the input with JSON-typed parameters, one progress line per code cell, and a
stopped attempt's kernel checkpoint is restored so that the next one runs on from the next cell
(the job wrapper's module docstring says how).

Apart from ``jobwrapper`` (the wrapper every job attempt runs under, which needs the standard
library only) as the part that needs papermill and knows notebooks; the wrapper imports it only
when a notebook runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

from gpulab.spawner.singleuser.jobwrapper import (
    BEFORE_USER_CODE,
    DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
    say,
    say_platform_failure,
)


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
        #: whether one of the job's cells has started (before that, a failure is the kernel's)
        self.job_code_started = False
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
                self.job_code_started = True
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
            say(f"stopped: the kernel's checkpoint holds cells through {progress.completed}")


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
    kernel_start_timeout_seconds: int = DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
) -> int:
    """Execute a notebook with papermill; 0 when every cell ran, 1 when one raised,
    ``BEFORE_USER_CODE`` when the kernel did not start within ``kernel_start_timeout_seconds``
    or failed before the first of the job's cells (see the module docstring). Resumes from the
    kernel checkpoint a stopped attempt of the same run left (``GPULAB_CHECKPOINT_DIR``)."""
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
            start_timeout=kernel_start_timeout_seconds,
        )
    except PapermillExecutionError as e:
        say(f"cell {e.exec_count} raised {e.ename}: {e.evalue} (see {output_path})")
        return 1
    except Exception as e:
        progress = state.get("progress")
        # the engine began (the notebook was read and parameterized: her file is fine) and none
        # of her cells started: the kernel's start failed (nbclient's "Kernel didn't respond in
        # N seconds", a kernel that died at once)
        if progress is None or progress.job_code_started:
            raise
        say_platform_failure(f"the kernel did not start: {type(e).__name__}: {e}")
        return BEFORE_USER_CODE
    return 0
