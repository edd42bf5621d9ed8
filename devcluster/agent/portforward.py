"""Port forwarding through a simulated node's kubelet API, as the kubelet's websocket port
forward (pkg/kubelet/cri/streaming/portforward/websocket.go) serves it:

    GET /portForward/NS/POD[/UID]?port=P[&port=Q ...]          (websocket)

The API server proxies `pods/portforward` of a websocket client (kr8s, the Kubernetes Python
clients, dask-kubernetes' operator retiring workers from outside the cluster) straight to it,
with the client's `ports` turned into the kubelet's `port` parameters. Subprotocols as the
kubelet's: none or v4.channel.k8s.io (binary), v4.base64.channel.k8s.io (text). Port i of the
request has channel 2i for its data, both ways, and 2i+1 for the kubelet's errors; the first
message on each channel is the port, two bytes little-endian. Each port gets one connection, to
127.0.0.1:PORT in the pod's network namespace (as a container runtime connects, so a server the
pod binds to its own loopback is reached too); when it ends, the forward ends and the websocket
closes, as the kubelet's does (a client opens a websocket per connection).

kubectl port-forward of 1.30 and later tunnels SPDY inside the websocket
(`SPDY/3.1+portforward.k8s.io`), and kubectl before it speaks SPDY: neither is spoken here
(answered 400 saying so), as for exec.

Who may use it: the kubelet API answers only the API server's client certificate (the
middleware in `kubeletapi`), so a tenant reaches a pod's port this way only where the API
server's RBAC gives her `create` on `pods/portforward` in that pod's namespace; pods get no
API credentials of their own (automountServiceAccountToken: false), and their NetworkPolicy
keeps them off the kubelet port.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import WSMsgType, web

from .kube import log
from .podnet import connect_in

if TYPE_CHECKING:
    from .pods import PodWorker

#: the kubelet's port-forward subprotocols (a client that names none gets binary framing)
PROTOCOLS = ("v4.channel.k8s.io", "v4.base64.channel.k8s.io")
#: as the kubelet's copy (io.Copy's 32 KiB buffer): one message stays under the 64 KiB that
#: websocket clients take by default (httpx-ws, which kr8s uses, closes on a bigger one)
READ_BYTES = 32 * 1024


def requested_ports(values: list[str]) -> list[int] | str:
    """The ports of a request's `port` (the kubelet's) or `ports` (the API's) values, each a
    number or a comma-separated list, or what is wrong with them (the kubelet's wording)."""
    if not values:
        return 'query parameter "port" is required'
    ports: list[int] = []
    for value in values:
        if not value:
            return 'query parameter "port" cannot be empty'
        for item in value.split(","):
            try:
                port = int(item)
            except ValueError:
                return f'unable to parse "{item}" as a port'
            if not 0 < port < 65536:
                return f"port {port} must be > 0 and < 65536"
            ports.append(port)
    return ports


@dataclass
class _Framing:
    ws: web.WebSocketResponse
    base64: bool

    async def send(self, channel: int, data: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            if self.base64:
                await self.ws.send_str(chr(ord("0") + channel) + base64.b64encode(data).decode())
            else:
                await self.ws.send_bytes(bytes([channel]) + data)

    def decode(self, kind: WSMsgType, data: bytes | str) -> tuple[int, bytes] | None:
        if kind == WSMsgType.BINARY and isinstance(data, bytes) and data:
            return data[0], data[1:]
        if kind == WSMsgType.TEXT and isinstance(data, str) and data:
            if self.base64:
                return ord(data[0]) - ord("0"), base64.b64decode(data[1:])
            return ord(data[0]), data[1:].encode()
        return None


async def serve(request: web.Request, worker: PodWorker) -> web.StreamResponse:
    """One port forward into `worker`'s pod (found and checked by the caller)."""
    if request.headers.get("Upgrade", "").lower().startswith("spdy") or any(
        p.strip().startswith("SPDY/")
        for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
    ):
        return _refusal(
            400,
            "the gpulab dev cluster's kubelet forwards ports over websocket channels "
            "(v4.channel.k8s.io, as kr8s and the Kubernetes Python clients use), not SPDY "
            "(kubectl port-forward): use such a client, or a NodePort Service",
        )
    ports = requested_ports(request.query.getall("port", request.query.getall("ports", [])))
    if isinstance(ports, str):
        return _refusal(400, ports)
    if worker.phase != "Running":
        return _refusal(400, f'pod "{worker.ns}/{worker.name}" is not running')
    ws = web.WebSocketResponse(protocols=PROTOCOLS, autoping=True, max_msg_size=0)
    if not ws.can_prepare(request).ok:
        return _refusal(400, "port forwarding needs a websocket upgrade")
    await ws.prepare(request)
    framing = _Framing(ws, base64="base64" in (ws.ws_protocol or ""))
    for i, port in enumerate(ports):
        for channel in (2 * i, 2 * i + 1):
            await framing.send(channel, struct.pack("<H", port))
    return await _Session(framing, worker, ports).run()


class _Session:
    """The websocket's messages to each port's connection, and the connections' bytes back."""

    def __init__(self, framing: _Framing, worker: PodWorker, ports: list[int]) -> None:
        self.framing, self.worker, self.ports = framing, worker, ports
        self.inbound: dict[int, asyncio.Queue[bytes | None]] = {
            2 * i: asyncio.Queue() for i in range(len(ports))
        }

    async def run(self) -> web.WebSocketResponse:
        forwards = [
            asyncio.create_task(self._forward(2 * i, port)) for i, port in enumerate(self.ports)
        ]
        reader = asyncio.create_task(self._read_client())

        async def every_forward() -> None:
            await asyncio.gather(*forwards)

        forwarding = asyncio.create_task(every_forward())
        try:
            # the forward ends when every port's connection has, or when the client went away
            await asyncio.wait([reader, forwarding], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [reader, forwarding, *forwards]:
                task.cancel()
            await asyncio.gather(reader, forwarding, *forwards, return_exceptions=True)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.framing.ws.close()
        return self.framing.ws

    async def _read_client(self) -> None:
        async for msg in self.framing.ws:
            decoded = self.framing.decode(msg.type, msg.data)
            if decoded is None:
                continue
            channel, data = decoded
            queue = self.inbound.get(channel)
            if queue is not None and data:  # a message on an error channel is not the client's
                queue.put_nowait(data)
        for queue in self.inbound.values():
            queue.put_nowait(None)

    async def _forward(self, channel: int, port: int) -> None:
        worker = self.worker
        try:
            sock = await connect_in(worker.netns, port)
        except OSError as e:
            message = (
                f"error forwarding port {port} to pod {worker.name}, uid {worker.uid}: "
                f"failed to connect to localhost:{port} inside the pod's network: {e.strerror or e}"
            )
            log.info("pod %s/%s: %s", worker.ns, worker.name, message)
            await self.framing.send(channel + 1, message.encode())
            return
        reader, writer = await asyncio.open_connection(sock=sock)
        inbound = self.inbound[channel]

        async def to_pod() -> None:
            while (data := await inbound.get()) is not None:
                writer.write(data)
                await writer.drain()

        async def from_pod() -> None:
            while data := await reader.read(READ_BYTES):
                await self.framing.send(channel, data)

        both = [asyncio.create_task(to_pod()), asyncio.create_task(from_pod())]
        try:
            # as a container runtime's copy: the first direction to end ends the connection
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in both:
                task.cancel()
            await asyncio.gather(*both, return_exceptions=True)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def _refusal(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message)
