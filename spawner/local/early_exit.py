"""A local server that dies before it is ready: the start fails at once with the reason.

JupyterHub 6 answers a server that exits while it waits for it to respond with an uncaught 500
(`spawn_single_user` asks a spawn future that has not ended for its exception: InvalidStateError),
ten seconds late and without the reason. So the local spawners' `start()` returns only once the
server answers (the same wait JupyterHub does next, which then succeeds at its first try) or has
exited: then it raises an HTTP 500 naming the exit status and the reason, and JupyterHub's own
error path stops the start and relays the message to the client.

The reason comes from gpulab's prepare step (`gpulab.spawner.singleuser.checkpoint.prepare`),
which runs first as the server's account: it writes why it failed (the home it cannot make, the
command it cannot run) to a pipe the hub holds (`--report-fd`), and closes its end when it hands
over to the server. A server that exits later, on its own, is reported by its exit status; its
output is in the hub's log, as every server's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from subprocess import Popen

from jupyterhub.utils import AnyTimeoutError, wait_for_http_server
from tornado import web

#: at most this much of the prepare step's report is read (a line or two in practice)
REPORT_MAX_BYTES = 4096


class StartReport:
    """The hub's end of the prepare step's report pipe: what it wrote, once it closed its end."""

    def __init__(self) -> None:
        # neither end is inheritable: Popen's pass_fds gives the write end to this child alone
        self.read_fd, self.write_fd = os.pipe()

    def close_write_end(self) -> None:
        """After the child has it: the child's copy alone keeps the pipe open."""
        self.write_fd = self._close(self.write_fd)

    def read(self) -> str:
        """Whatever the child wrote (non-blocking: the child has exited or handed over)."""
        if self.read_fd < 0:
            return ""
        os.set_blocking(self.read_fd, False)
        chunks = []
        with contextlib.suppress(BlockingIOError, OSError):
            while data := os.read(self.read_fd, REPORT_MAX_BYTES):
                chunks.append(data)
                if sum(map(len, chunks)) >= REPORT_MAX_BYTES:
                    break
        return b"".join(chunks)[:REPORT_MAX_BYTES].decode(errors="replace").strip()

    def close(self) -> None:
        self.read_fd = self._close(self.read_fd)
        self.write_fd = self._close(self.write_fd)

    @staticmethod
    def _close(fd: int) -> int:
        """Close `fd` once: a number closed twice may meanwhile be another socket's."""
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        return -1


async def _exited(proc: Popen[bytes]) -> int:
    """The process's exit status, once it has exited: its pidfd becomes readable then (the
    process is the hub's child and not reaped before this reads it, so its pid is its own)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        pidfd = -1
    if pidfd >= 0:
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(pidfd, readable)
        try:
            await gone
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
    status = proc.wait()  # exited: reaps at once
    return status


def exit_message(name: str, status: int, report: str) -> str:
    """What the person starting the server reads when it died before it was ready."""
    how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    reason = report or "its output is in the hub's log"
    return f"{name} {how} before it was ready: {reason}"


async def wait_ready_or_exit(
    proc: Popen[bytes],
    url: str,
    *,
    name: str,
    report: StartReport,
    timeout: float,
) -> None:
    """Return once the server at `url` answers HTTP (any status under 500, as JupyterHub's own
    wait); raise `web.HTTPError(500)` with the reason when its process exits first, or when it
    does not answer within `timeout` seconds."""
    ready = asyncio.ensure_future(wait_for_http_server(url, timeout=timeout))
    exited = asyncio.ensure_future(_exited(proc))
    try:
        done, _ = await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (ready, exited):
            task.cancel()
    if exited in done and not (ready in done and not ready.exception()):
        raise web.HTTPError(500, exit_message(name, exited.result(), report.read()))
    try:
        ready.result()
    except AnyTimeoutError:
        raise web.HTTPError(
            500, f"{name} did not answer at {url} within {timeout:g} s (Spawner.http_timeout)"
        ) from None
