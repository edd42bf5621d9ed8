"""A simulated node's kubelet API (the part the API server proxies to): container logs, exec,
attach and port forwarding (`portforward`), over HTTPS on the node's InternalIP at
status.daemonEndpoints.kubeletEndpoint.Port.

    GET /containerLogs/NS/POD/CONTAINER?follow&tailLines&timestamps&previous&sinceSeconds&
        sinceTime&limitBytes                         -> the output, as the kubelet answers it
    GET /exec/NS/POD/CONTAINER?command=..&stdin&stdout&stderr&tty   (websocket)
    GET /attach/NS/POD/CONTAINER?stdin&stdout&stderr&tty            (websocket)
    GET /portForward/NS/POD?port=P                                  (websocket, `portforward`)

Websocket subprotocols as the kubelet's: v5/v4/v3/v2.channel.k8s.io and channel.k8s.io (plus the
base64 variants): each message is one channel byte (0 stdin, 1 stdout, 2 stderr, 3 error, 4
resize, 255 close stdin in v5) and its data. v4 and v5 end with a metav1.Status on channel 3
(Success, or Failure with the exit code as cause ExitCode). SPDY (kubectl before 1.30 uses it
for exec) is not spoken: such a request is answered 400 with a message saying so.

Who may call it: only the API server. Pods of every tenant share the host network, so a pod can
connect to every node's kubelet port; an unauthenticated kubelet API would let any pod exec
into any other tenant's pod or read its logs. So the server REQUIRES a client certificate
signed by the cluster's kubelet CA (`pki.KubeletPKI`, made at `up`; its key and the API
server's client key are in STATE/secrets, root's alone) and naming the API server
(CN kube-apiserver-kubelet-client); the API server's own authorization (RBAC on pods/log,
pods/exec, pods/attach, pods/portforward) decides which user may reach it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import socket
import ssl
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from ..pki import APISERVER_CLIENT_CN, KubeletPKI
from . import crilog, portforward
from .kube import log
from .podstate import ContainerState
from .runtime import StartError, kill_session

if TYPE_CHECKING:
    from .pods import PodManager, PodWorker

KUBELET_PORT = 10250
STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255
#: the kubelet's order of preference (a client's first match in this list wins)
PROTOCOLS = (
    "v5.channel.k8s.io",
    "v4.channel.k8s.io",
    "v3.channel.k8s.io",
    "v2.channel.k8s.io",
    "channel.k8s.io",
    "v4.base64.channel.k8s.io",
    "v3.base64.channel.k8s.io",
    "v2.base64.channel.k8s.io",
    "base64.channel.k8s.io",
)
FOLLOW_POLL_SECONDS = 0.2


def server_context(pki: KubeletPKI, cert: Path, key: Path) -> ssl.SSLContext:
    """TLS with the node's serving certificate; a client certificate of the CA is required."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(cafile=pki.ca_cert)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _client_cn(request: web.Request) -> str | None:
    transport = request.transport
    cert = transport.get_extra_info("peercert") if transport is not None else None
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


@web.middleware
async def _only_the_api_server(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    # TLS already refused a client without a certificate of the CA; the CA signs node serving
    # certificates too, so the name must be the API server's
    if _client_cn(request) != APISERVER_CLIENT_CN:
        return web.Response(status=403, text="Forbidden: only the API server may call the kubelet")
    return await handler(request)


def _bool(request: web.Request, name: str) -> bool:
    return request.query.get(name, "").lower() in ("1", "true")


def _text_error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message)


def _status_error(status: int, message: str) -> web.Response:
    """A refused exec or attach upgrade as a metav1.Status: what clients decode and print
    (kubectl: "Error from server (BadRequest): <message>")."""
    reasons = {400: "BadRequest", 404: "NotFound"}
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reasons.get(status, "InternalError"),
        "code": status,
    }
    return web.json_response(body, status=status)


class KubeletServer:
    """One node's kubelet API; start() serves it on a listening socket (the node's address in
    the nodes' network namespace) with the node's serving certificate."""

    def __init__(self, node_name: str, pods: PodManager) -> None:
        self.node_name, self.pods = node_name, pods
        self.runner: web.AppRunner | None = None

    async def start(self, sock: socket.socket, tls: ssl.SSLContext) -> None:
        app = web.Application(middlewares=[_only_the_api_server])
        app.router.add_get("/containerLogs/{ns}/{pod}/{container}", self.container_logs)
        for verb in ("exec", "attach"):
            handler = self.exec if verb == "exec" else self.attach
            for route in (f"/{verb}/{{ns}}/{{pod}}/{{container}}",
                          f"/{verb}/{{ns}}/{{pod}}/{{uid}}/{{container}}"):  # fmt: skip
                app.router.add_get(route, handler)
                app.router.add_post(route, handler)
        for route in ("/portForward/{ns}/{pod}", "/portForward/{ns}/{pod}/{uid}"):
            app.router.add_get(route, self.port_forward)
            app.router.add_post(route, self.port_forward)
        app.router.add_get("/healthz", lambda _r: self._ok())
        # a stopping node (simulated failure, agent exit) cancels open follows and exec sessions
        # after a second instead of waiting for them (aiohttp's default: 60 s)
        self.runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0
        )
        await self.runner.setup()
        await web.SockSite(self.runner, sock, ssl_context=tls).start()
        ip, port = sock.getsockname()[:2]
        log.info("node %s: kubelet API on https://%s:%d", self.node_name, ip, port)

    async def _ok(self) -> web.Response:
        return web.Response(text="ok")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def _pod(
        self, request: web.Request, error: Callable[[int, str], web.Response] = _text_error
    ) -> PodWorker | web.Response:
        ns, pod = request.match_info["ns"], request.match_info["pod"]
        worker = self.pods.find(ns, pod)
        if worker is None:
            return error(404, f'pod "{ns}/{pod}" not found on node {self.node_name}')
        uid = request.match_info.get("uid")
        if uid and uid != worker.uid:
            return error(404, f'pod "{ns}/{pod}" with uid {uid} not found')
        return worker

    def _container(
        self, request: web.Request, error: Callable[[int, str], web.Response] = _text_error
    ) -> tuple[PodWorker, ContainerState] | web.Response:
        worker = self._pod(request, error)
        if isinstance(worker, web.Response):
            return worker
        ns, pod, name = worker.ns, worker.name, request.match_info["container"]
        for cs in [*worker.init, *worker.containers]:
            if cs.name == name:
                return worker, cs
        return error(404, f'container "{name}" not found in pod "{ns}/{pod}"')

    # -- logs -------------------------------------------------------------------------------

    async def container_logs(self, request: web.Request) -> web.StreamResponse:
        found = self._container(request)
        if isinstance(found, web.Response):
            return found
        worker, cs = found
        q = request.query
        previous, follow, stamps = (_bool(request, k) for k in ("previous", "follow", "timestamps"))
        try:
            tail = int(q["tailLines"]) if q.get("tailLines") else None
            limit = int(q["limitBytes"]) if q.get("limitBytes") else None
            since_ns = 0
            if q.get("sinceSeconds"):
                since_ns = time.time_ns() - int(q["sinceSeconds"]) * 1_000_000_000
            elif q.get("sinceTime"):
                since_ns = crilog.parse_time(q["sinceTime"])
        except ValueError as e:
            return _text_error(400, f"bad log options: {e}")
        path = worker.dir / f"{cs.name}.log"
        if previous:
            path = path.with_name(f"{cs.name}.log.previous")
            if not path.exists():
                return _text_error(
                    400,
                    f'previous terminated container "{cs.name}" in pod "{worker.name}" not found',
                )
        elif cs.proc is None or not path.exists():
            reason = cs.waiting.get("reason") or "ContainerCreating"
            return _text_error(
                400,
                f'container "{cs.name}" in pod "{worker.name}" is waiting to start: {reason}',
            )
        proc = cs.proc  # the run being read: follow ends with it
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        budget = [limit if limit is not None and limit >= 0 else -1]

        async def send(recs: list[crilog.Record]) -> bool:
            """Write records; False once limitBytes is used up."""
            out = b"".join(
                (crilog.rfc3339_nano(r.time_ns, trim=True).encode() + b" " if stamps else b"")
                + r.plain()
                for r in recs
                if r.time_ns >= since_ns
            )
            if budget[0] >= 0:
                out, budget[0] = out[: budget[0]], budget[0] - min(len(out), budget[0])
            if out:
                await resp.write(out)
            return budget[0] != 0

        # kept open: a restart renames the file, and the run asked for is this one
        fh = await asyncio.to_thread(path.open, "rb")
        with fh:
            data = await asyncio.to_thread(fh.read)
            complete, rest = crilog.split_complete(data)
            if tail is not None:  # only the end is parsed: a long log's tail stays cheap
                complete = complete[crilog.tail_start(complete, tail) :]
            more = await send(list(crilog.records(complete)))
            while follow and not previous and more:
                ended = proc is None or not proc.running
                chunk = await asyncio.to_thread(fh.read)
                if chunk:
                    data = rest + chunk
                    complete, rest = crilog.split_complete(data)
                    more = await send(list(crilog.records(complete)))
                elif ended:
                    break
                else:
                    await asyncio.sleep(FOLLOW_POLL_SECONDS)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    # -- port forwarding, exec and attach ---------------------------------------------------

    async def port_forward(self, request: web.Request) -> web.StreamResponse:
        worker = self._pod(request)
        if isinstance(worker, web.Response):
            return worker
        return await portforward.serve(request, worker)

    def _streaming_to(
        self, request: web.Request
    ) -> tuple[PodWorker, ContainerState, _Channels] | web.Response:
        """The running container and the channels an exec or attach asks for, or the refusal."""
        found = self._container(request, _status_error)
        if isinstance(found, web.Response):
            return found
        worker, cs = found
        if cs.proc is None or not cs.running:
            return _status_error(400, f'container "{cs.name}" is not running')
        channels = _Channels.requested(request)
        if isinstance(channels, web.Response):
            return channels
        return worker, cs, channels

    async def exec(self, request: web.Request) -> web.StreamResponse:
        found = self._streaming_to(request)
        if isinstance(found, web.Response):
            return found
        _worker, cs, channels = found
        command = request.query.getall("command", [])
        if not command:
            return _status_error(400, "exec needs a command")
        try:
            argv = cs.proc.exec_argv(
                command,
                cwd=cs.working_dir,
                identity=cs.identity,
                tty=channels.tty,
            )
        except StartError as e:
            return _status_error(400, str(e))
        ws = await channels.accept(request)
        await _Session(ws, channels, argv, cs.env).run()
        return ws

    async def attach(self, request: web.Request) -> web.StreamResponse:
        found = self._streaming_to(request)
        if isinstance(found, web.Response):
            return found
        worker, cs, channels = found
        if channels.stdin or channels.tty:
            # containers run with stdin closed and no terminal here (a pod's `stdin`/`tty` are
            # not simulated): what the runtime answers for such a container
            return _status_error(400, f'container "{cs.name}" has no stdin or tty to attach to')
        ws = await channels.accept(request)
        await _attach_output(ws, channels, worker.dir / f"{cs.name}.log", cs)
        return ws


class _Channels:
    """What the client asked for and how the chosen subprotocol frames channels."""

    def __init__(self, stdin: bool, stdout: bool, stderr: bool, tty: bool) -> None:
        self.stdin, self.stdout, self.tty = stdin, stdout, tty
        self.stderr = stderr and not tty  # a terminal has one output stream
        self.protocol = ""
        self.ws: web.WebSocketResponse

    @classmethod
    def requested(cls, request: web.Request) -> _Channels | web.Response:
        if request.headers.get("Upgrade", "").lower().startswith("spdy"):
            return _status_error(
                400,
                "the gpulab dev cluster's kubelet speaks websocket (v4/v5.channel.k8s.io), not "
                "SPDY: use a websocket client (kubectl 1.30+, kubernetes_asyncio.stream)",
            )
        # the API server asks with the kubelet's own names (input, output, error)
        return cls(
            *(
                _bool(request, kubelet) or _bool(request, api)
                for kubelet, api in (
                    ("input", "stdin"),
                    ("output", "stdout"),
                    ("error", "stderr"),
                    ("tty", "tty"),
                )
            )
        )

    async def accept(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=PROTOCOLS, autoping=True, max_msg_size=0)
        ready = ws.can_prepare(request)
        if not ready.ok:
            raise web.HTTPBadRequest(text="exec and attach need a websocket upgrade")
        await ws.prepare(request)
        self.ws, self.protocol = ws, ws.ws_protocol or "channel.k8s.io"
        # as the kubelet: an empty message on the first output channel says the streams are up
        first = STDOUT if self.stdout else STDERR if self.stderr else ERROR
        await self.send(first, b"")
        return ws

    @property
    def base64(self) -> bool:
        return "base64" in self.protocol

    @property
    def status_json(self) -> bool:
        return self.protocol.startswith(("v4.", "v5."))

    async def send(self, channel: int, data: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            if self.base64:
                await self.ws.send_str(chr(ord("0") + channel) + base64.b64encode(data).decode())
            else:
                await self.ws.send_bytes(bytes([channel]) + data)

    def decode(self, msg: Any) -> tuple[int, bytes] | None:
        if msg.type == WSMsgType.BINARY and msg.data:
            return msg.data[0], msg.data[1:]
        if msg.type == WSMsgType.TEXT and msg.data:
            if self.base64:
                return ord(msg.data[0]) - ord("0"), base64.b64decode(msg.data[1:])
            return ord(msg.data[0]), msg.data[1:].encode()
        return None

    async def finish(self, exit_code: int | None, error: str | None = None) -> None:
        """The error channel's last word, then close (v4/v5: a metav1.Status; before: text,
        nothing on success)."""
        if error is None and exit_code not in (None, 0):
            error = f"command terminated with non-zero exit code: exit code {exit_code}"
        if self.status_json:
            status: dict[str, Any] = {"metadata": {}, "status": "Success"}
            if error is not None:
                status = {"metadata": {}, "status": "Failure", "message": error}
                if exit_code not in (None, 0):
                    status["reason"] = "NonZeroExitCode"
                    status["details"] = {
                        "causes": [{"reason": "ExitCode", "message": str(exit_code)}]
                    }
            await self.send(ERROR, json.dumps(status).encode())
        elif error is not None:
            await self.send(ERROR, error.encode())
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.close()


class _Session:
    """One exec: the command's stdio to and from the websocket's channels, then its status."""

    def __init__(
        self, ws: web.WebSocketResponse, ch: _Channels, argv: list[str], env: dict[str, str]
    ) -> None:
        self.ws, self.ch, self.argv, self.env = ws, ch, argv, env
        self.master: int | None = None

    async def run(self) -> None:
        ch = self.ch
        try:
            if ch.tty:
                self.master, slave = os.openpty()
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *self.argv, env=self.env, stdin=slave, stdout=slave, stderr=slave,
                        start_new_session=True,
                    )  # fmt: skip
                finally:
                    os.close(slave)
            else:
                pipe, null = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
                proc = await asyncio.create_subprocess_exec(
                    *self.argv,
                    env=self.env,
                    stdin=pipe if ch.stdin else null,
                    stdout=pipe if ch.stdout else null,
                    stderr=pipe if ch.stderr else null,
                    start_new_session=True,
                )
        except OSError as e:
            await ch.finish(None, f"exec failed: {e}")
            if self.master is not None:
                os.close(self.master)
            return
        outputs = (
            [self._pump_terminal()]
            if self.master is not None
            else [self._pump(proc.stdout, STDOUT), self._pump(proc.stderr, STDERR)]
        )
        reader = asyncio.create_task(self._read_client(proc))
        try:
            await asyncio.gather(*outputs)
            code = await proc.wait()
            await ch.finish(code)
        finally:
            reader.cancel()
            if proc.returncode is None:  # the client went away: the command goes too
                kill_session(proc.pid)
                await proc.wait()
            if self.master is not None:
                os.close(self.master)

    async def _pump(self, stream: asyncio.StreamReader | None, channel: int) -> None:
        while stream is not None and (chunk := await stream.read(65536)):
            await self.ch.send(channel, chunk)

    async def _pump_terminal(self) -> None:
        assert self.master is not None
        master = self.master
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def readable() -> None:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal is gone
                data = b""
            if not data:
                loop.remove_reader(master)
            queue.put_nowait(data)

        os.set_blocking(master, False)
        loop.add_reader(master, readable)
        try:
            while chunk := await queue.get():
                await self.ch.send(STDOUT, chunk)
        finally:
            loop.remove_reader(master)

    async def _read_client(self, proc: asyncio.subprocess.Process) -> None:
        async for msg in self.ws:
            decoded = self.ch.decode(msg)
            if decoded is None:
                continue
            channel, data = decoded
            if channel == STDIN and self.ch.stdin:
                await self._write_stdin(proc, data)
            elif channel == RESIZE and self.master is not None and data:
                with contextlib.suppress(ValueError, KeyError, TypeError, OSError, struct.error):
                    size = json.loads(data)  # a malformed resize is ignored, as the kubelet does
                    winsize = struct.pack("HHHH", int(size["Height"]), int(size["Width"]), 0, 0)
                    fcntl.ioctl(self.master, termios.TIOCSWINSZ, winsize)
            elif channel == CLOSE and data[:1] == bytes([STDIN]):  # v5: the client's stdin ended
                self._close_stdin(proc)
        if proc.returncode is None:  # the client went away: so does the command
            kill_session(proc.pid)

    async def _write_stdin(self, proc: asyncio.subprocess.Process, data: bytes) -> None:
        if self.master is not None:
            with contextlib.suppress(OSError):
                os.write(self.master, data)
        elif proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.write(data)
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()

    def _close_stdin(self, proc: asyncio.subprocess.Process) -> None:
        if self.master is not None:
            with contextlib.suppress(OSError):
                os.write(self.master, b"\x04")  # EOF at the start of a terminal line
        elif proc.stdin is not None:
            proc.stdin.close()


async def _attach_output(
    ws: web.WebSocketResponse, ch: _Channels, path: Path, cs: ContainerState
) -> None:
    """Attach without stdin: what the container writes from now on, on stdout/stderr, until it
    exits or the client goes (the output is read back from its log, where the launcher puts
    it)."""
    proc = cs.proc

    async def client_gone() -> None:
        async for _ in ws:
            pass

    gone = asyncio.create_task(client_gone())
    try:
        fh = await asyncio.to_thread(path.open, "rb")
        with fh:
            fh.seek(0, os.SEEK_END)
            rest = b""
            while not gone.done():
                ended = proc is None or not proc.running
                chunk = await asyncio.to_thread(fh.read)
                if chunk:
                    data = rest + chunk
                    complete, rest = crilog.split_complete(data)
                    for r in crilog.records(complete):
                        if r.stream == "stderr" and ch.stderr:
                            await ch.send(STDERR, r.plain())
                        elif r.stream == "stdout" and ch.stdout:
                            await ch.send(STDOUT, r.plain())
                elif ended:
                    break
                else:
                    await asyncio.sleep(FOLLOW_POLL_SECONDS)
        await ch.finish(None)
    finally:
        gone.cancel()
