"""The hub's end of an owner's Dask fork server (``gpulab.spawner.singleuser.dask_forkserver``,
which runs as her): requests out, answers and her children's exit statuses in, read by the event
loop; and the fork server's own exit, reaped the moment it happens.

The fork server is the hub's child (``Sessions.spawn``). It ends by itself (idle for
``forkserver_idle_seconds``, or its socket closed by the hub), and a child that ends stays a
zombie of the hub's until the hub waits for it: every fork server that ever ended would be one.
So the hub watches its pidfd (readable once it has ended, no polling) and reaps it then.

Why one. A scheduler or worker started cold spends most of its start importing distributed
(bokeh too, for a scheduler's dashboard); the fork server, started as the owner with the same
clean environment as her other processes, has it imported. It talks to the hub over a socket
pair only the hub holds the other end of, and ends when the hub closes its end (``close()``, or
the hub's exit) or after ``forkserver_idle_seconds`` with no child.

What it says is the owner's (she can write to her own process): every pid it names is checked
by the executor against the kernel before the hub takes it for its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpulab.spawner.local.dask_files import DaskExecutorError
from gpulab.spawner.local.processes import Started

FORKSERVER_MODULE = "gpulab.spawner.singleuser.dask_forkserver"
#: the Python start-up variables a forked process honours like a new interpreter (the fork
#: server applies PYTHONPATH; PYTHONUNBUFFERED is in every environment it starts from); any
#: other PYTHON* variable changes how Python starts, so such a process starts cold
FORKABLE_PYTHON_VARIABLES = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED"})
#: after a fork server failed to start, starts stay cold this long before it is tried again
FORKSERVER_RETRY_SECONDS = 60.0
#: how long a fork server may take to answer a start
FORKSERVER_ANSWER_SECONDS = 10.0
#: the longest message the hub reads from a fork server (its answers are small JSON objects)
MAX_ANSWER_BYTES = 1 << 16
#: how soon the hub tries again to reap a fork server whose pidfd said it ended but that the
#: kernel did not hand over yet
REAP_RETRY_SECONDS = 0.05


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a process with ``env`` may be forked by the fork server (pure): no Python
    start-up variable but those it applies (``FORKABLE_PYTHON_VARIABLES``)."""
    return not any(
        name.startswith("PYTHON") and name not in FORKABLE_PYTHON_VARIABLES for name in env
    )


def parent_pid(pid: int) -> int | None:
    """The parent pid of ``pid`` (/proc/<pid>/stat field 4), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def owner_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class ForkServer:
    """The hub's end of one owner's fork server (see the module docstring): requests out,
    answers and children's exit statuses in, its own exit seen, read by the event loop (no
    thread waits on it)."""

    def __init__(
        self, started: Started, control: socket.socket, uid: int, reap: Callable[[], bool]
    ) -> None:
        """``reap()``: wait for the fork server's process without blocking (``Sessions.running``
        on it, then ``forget``); true once it was reaped, false while it still runs."""
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
        self._reap = reap
        #: whether the hub has waited for its process (no zombie of the hub's left)
        self.reaped = False
        self._pidfd: int | None = os.pidfd_open(started.pid)
        loop.add_reader(self._pidfd, self._ended)

    def _readable(self) -> None:
        try:
            data = self.control.recv(MAX_ANSWER_BYTES)
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

    def _ended(self) -> None:
        """Its pidfd is readable: the process ended. The hub's end closes (nothing answers any
        more) and the process is reaped, now or a moment later (the kernel hands a process over
        once all its threads are gone)."""
        self.close()
        self._unwatch()
        if not self.check_reaped():
            asyncio.get_running_loop().call_later(REAP_RETRY_SECONDS, self._ended)

    def _unwatch(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def check_reaped(self) -> bool:
        """Reap the fork server's process if it ended (``Sessions.stop`` may have reaped it
        first); true once no zombie of it is left."""
        if not self.reaped and self._reap():
            self.reaped = True
            self._unwatch()
        return self.reaped
