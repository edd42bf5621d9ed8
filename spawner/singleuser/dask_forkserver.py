"""A warm launcher of one owner's Dask schedulers and workers: Dask imported once, every process
forked from it.

Why. A scheduler or worker started as a new process spends most of its start importing
distributed (and the scheduler bokeh, for its dashboard): about half a second of CPU each, so
a cluster of four workers took twice the cluster-up time of a `distributed.LocalCluster`, whose
scheduler lives in the caller's already warm process (bench.dask). This process imports all of
it once, as the owner, and forks each scheduler or worker the hub asks for.

`python -m gpulab.spawner.singleuser.dask_forkserver --control-fd N` is what the local Dask
executor (``gpulab.spawner.local.dask``) starts as the owner, in a session of its own, with the
same clean environment as her other processes. Runs as the owner: it imports nothing of the
hub's.

Protocol: fd N is one end of a ``SOCK_SEQPACKET`` socket pair whose other end only the hub
holds (no path: no other process can connect). One JSON object per message:

- it sends ``{"ready": true}`` once warm (or exits: a process with a thread cannot fork safely);
- the hub sends ``{"id": n, "launcher": "scheduler"|"worker", "argv": [...], "env": {...}}``
  with the process's log as an ``SCM_RIGHTS`` descriptor; it answers ``{"id": n, "pid": p}``
  or ``{"id": n, "error": "..."}``;
- when a child ends it sends ``{"exited": p, "status": s}`` (``Popen.returncode``'s
  convention: negative for a signal).

A child: a session of its own (the hub stops it by session, as a process it started itself),
stdin /dev/null, stdout and stderr on its log, cwd ``/``, umask 022, exactly the environment
sent (``os.environ`` replaced, Dask's config read again from it: ``DASK_CONFIG`` is per cluster;
``PYTHONPATH`` applied as Python's start applies it, its ``sitecustomize`` run: the GPU caps
hook; the hub starts cold any process whose environment holds another ``PYTHON*`` variable),
fresh random state, the title of the command a cold start would run (``ps`` shows the same),
then the launcher's ``main``. The hub checks every pid it is told against the kernel (the
owner's uid, a session of its own, this process's child) before it takes it for its own: the
owner can write to this process, and what it says is hers.

It ends when the hub closes its end (the hub stopped or restarted; the children, in sessions of
their own, live on), or after ``--idle-seconds`` with no child and no request.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from gpulab.spawner.singleuser import dask_worker

#: the largest request (argv and environment) the hub sends
MAX_MESSAGE_BYTES = 1 << 20
LAUNCHERS = ("scheduler", "worker")


def warm_up() -> None:
    """Import what a scheduler and a worker import as they start (their CLIs, distributed, and
    the scheduler's dashboard where bokeh is installed)."""
    import distributed  # noqa: F401
    import distributed.cli.dask_scheduler  # noqa: F401
    import distributed.cli.dask_worker  # noqa: F401

    import gpulab.spawner.singleuser.dask_scheduler  # noqa: F401

    # no bokeh: the scheduler runs without its dashboard anyway
    with contextlib.suppress(ImportError):
        import distributed.dashboard.scheduler  # noqa: F401
    # set up here, not in a child: it finds the memory it rewrites (argv, then the environment
    # it moves away) only while the environment is as the process started
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(setproctitle.getproctitle())


def apply_pythonpath(pythonpath: str) -> None:
    """What a fresh interpreter does with ``PYTHONPATH``: its entries first on ``sys.path``, and
    the first ``sitecustomize`` among them run (gpulab's framework caps hook is one)."""
    entries = [os.path.abspath(e) for e in pythonpath.split(os.pathsep) if e]
    for offset, entry in enumerate(e for e in entries if e not in sys.path):
        sys.path.insert(1 + offset, entry)
    for entry in entries:
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("sitecustomize", path)
            if spec is None or spec.loader is None:
                return
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            return


def child_title(launcher: str, argv: Sequence[str]) -> str:
    """What ``ps`` shows for a forked child: the command a cold start runs (pure)."""
    module = f"gpulab.spawner.singleuser.dask_{launcher}"
    return " ".join([sys.executable, "-m", module, *argv])


def _become(env: Mapping[str, str], log_fd: int, launcher: str, argv: Sequence[str]) -> None:
    """In the forked child: the process a cold start would be (see the module docstring)."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)
    os.chdir("/")
    os.umask(0o022)
    os.environ.clear()
    os.environ.update(env)
    apply_pythonpath(env.get("PYTHONPATH", ""))
    dask_worker.reload_dask_config()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "setproctitle" in sys.modules:
        sys.modules["setproctitle"].setproctitle(child_title(launcher, argv))
    sys.argv = [f"dask_{launcher}", *argv]


def _run_child(
    control: socket.socket, request: Mapping[str, Any], log_fd: int, settled: int
) -> None:
    """The forked child's whole life; never returns."""
    code = 1
    try:
        control.close()
        launcher, argv = request["launcher"], list(request["argv"])
        _become(request["env"], log_fd, launcher, argv)
        os.write(settled, b"1")
        os.close(settled)
        if launcher == "scheduler":
            from gpulab.spawner.singleuser import dask_scheduler

            dask_scheduler.main(argv)
        else:
            dask_worker.main(argv)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is None:
            code = 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with_flush()
        os._exit(code)


def with_flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _check_request(request: Any) -> str:
    """Why a request is malformed, or "" (pure)."""
    if not isinstance(request, dict):
        return "a request is a JSON object"
    if not isinstance(request.get("id"), int):
        return "id must be an integer"
    if request.get("launcher") not in LAUNCHERS:
        return f"launcher must be one of {', '.join(LAUNCHERS)}"
    argv, env = request.get("argv"), request.get("env")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return "argv must be a list of strings"
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        return "env must map strings to strings"
    return ""


class ForkServer:
    """The serving loop (see the module docstring)."""

    def __init__(self, control: socket.socket, idle_seconds: float) -> None:
        self.control = control
        self.idle_seconds = idle_seconds
        self.children: set[int] = set()
        self.last_activity = time.monotonic()
        # SIGCHLD wakes the loop at once, so a child's end is reported without delay
        self.wakeup_r, self.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def send(self, message: Mapping[str, Any]) -> None:
        with contextlib.suppress(ConnectionError):  # the hub closed its end: the loop sees it
            self.control.send(json.dumps(message).encode())

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.last_activity = time.monotonic()
            self.send({"exited": pid, "status": os.waitstatus_to_exitcode(status)})

    def start(self, request: dict[str, Any], fds: list[int]) -> None:
        why = _check_request(request) or ("" if len(fds) == 1 else "send exactly one log fd")
        if why:
            for fd in fds:
                os.close(fd)
            self.send(
                {"id": request.get("id") if isinstance(request, dict) else None, "error": why}
            )
            return
        with_flush()
        # the child says when it leads its session: the hub checks that before it takes the pid
        settled_r, settled_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            os.close(settled_r)
            os.close(self.wakeup_r)
            os.close(self.wakeup_w)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _run_child(self.control, request, fds[0], settled_w)
        os.close(settled_w)
        os.close(fds[0])
        self.children.add(pid)
        os.read(settled_r, 1)  # b"" when it died first: the hub then finds it gone
        os.close(settled_r)
        self.send({"id": request["id"], "pid": pid})

    def serve(self) -> int:
        self.send({"ready": True, "pid": os.getpid()})
        while True:
            self.reap()
            idle_for = time.monotonic() - self.last_activity
            if not self.children and idle_for >= self.idle_seconds:
                return 0
            timeout = max(0.05, self.idle_seconds - idle_for) if not self.children else None
            readable, _, _ = select.select([self.control, self.wakeup_r], [], [], timeout)
            if self.wakeup_r in readable:
                while True:
                    try:
                        if not os.read(self.wakeup_r, 512):
                            break
                    except BlockingIOError:
                        break
            if self.control not in readable:
                continue
            try:
                message, fds, _flags, _addr = socket.recv_fds(self.control, MAX_MESSAGE_BYTES, 4)
            except ConnectionError:
                message, fds = b"", []
            if not message:
                return 0  # the hub closed its end
            self.last_activity = time.monotonic()
            try:
                request = json.loads(message)
            except ValueError:
                request = None
            self.start(request, fds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpulab dask fork server")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    warm_up()
    if threading.active_count() != 1:
        print(
            f"gpulab: {threading.active_count()} threads after the imports; forking is unsafe",
            file=sys.stderr,
        )
        return 3
    return ForkServer(control, args.idle_seconds).serve()


if __name__ == "__main__":
    sys.exit(main())
