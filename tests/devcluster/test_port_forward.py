"""Port forwarding through the API server to a simulated node's kubelet API (`pods/portforward`),
with the clients that use it: kr8s, as dask-kubernetes' operator does to retire workers from
outside the cluster, and kubernetes_asyncio's websocket client (v4.channel.k8s.io)."""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.stream import WsApiClient

from gpulab.devcluster import DevCluster
from gpulab.devcluster.agent.portforward import requested_ports
from tests.harness.kube import Kube, pod_manifest
from tests.harness.wait import wait_for

#: an echo server on the pod's loopback only, and a line on another port saying who it is
ECHO = r"""
import socket, sys, threading
def echo():
    s = socket.create_server(("127.0.0.1", 7001))
    while True:
        c, _ = s.accept()
        def serve(c=c):
            with c:
                while data := c.recv(65536):
                    c.sendall(data.upper())
        threading.Thread(target=serve, daemon=True).start()
def hello():
    s = socket.create_server(("0.0.0.0", 7002))
    while True:
        c, _ = s.accept()
        with c:
            c.sendall(b"hello from " + socket.gethostname().encode() + b"\n")
threading.Thread(target=echo, daemon=True).start()
print("listening", flush=True)
hello()
"""


@pytest.fixture
async def ws_core(dev_cluster: DevCluster) -> AsyncIterator[client.CoreV1Api]:
    cfg = client.Configuration()
    await config.load_kube_config(str(dev_cluster.kubeconfig), client_configuration=cfg)
    ws = WsApiClient(configuration=cfg)
    try:
        yield client.CoreV1Api(api_client=ws)
    finally:
        await ws.close()


def _echo_pod(kube: Kube) -> tuple[str, str]:
    name = kube.name("forward")
    kube.create_pod(pod_manifest(name, [sys.executable, "-c", ECHO]))
    pod = kube.wait_phase(name, "Running")
    wait_for("the pod's servers", lambda: "listening" in kube.cluster.logs(name, kube.ns))
    return name, pod["status"]["podIP"]


def test_the_requested_ports_are_read_as_the_kubelet_reads_them() -> None:
    assert requested_ports(["8787"]) == [8787]
    assert requested_ports(["80,443", "8080"]) == [80, 443, 8080]
    assert requested_ports([]) == 'query parameter "port" is required'
    assert requested_ports([""]) == 'query parameter "port" cannot be empty'
    assert requested_ports(["http"]) == 'unable to parse "http" as a port'
    assert requested_ports(["0"]) == "port 0 must be > 0 and < 65536"
    assert requested_ports(["70000"]) == "port 70000 must be > 0 and < 65536"


async def test_kr8s_forwards_to_a_server_on_the_pods_own_loopback(kube_ns: Kube) -> None:
    import kr8s.asyncio
    from kr8s.asyncio.objects import Pod

    name, pod_ip = await asyncio.to_thread(_echo_pod, kube_ns)
    # the echo server listens on the pod's loopback: nothing outside the pod reaches it
    with pytest.raises(OSError):
        socket.create_connection((pod_ip, 7001), timeout=3).close()

    api = await kr8s.asyncio.api(kubeconfig=str(kube_ns.cluster.kubeconfig))
    pod = await Pod.get(name, namespace=kube_ns.ns, api=api)
    async with pod.portforward(7001, local_port="auto") as port:
        # two connections at once: kr8s opens a websocket (one forward) for each
        first = await asyncio.open_connection("127.0.0.1", port)
        second = await asyncio.open_connection("127.0.0.1", port)
        for i, (reader, writer) in enumerate((first, second)):
            writer.write(f"ping {i}\n".encode())
            await writer.drain()
            assert await asyncio.wait_for(reader.readline(), 30) == f"PING {i}\n".encode()
        # a large write comes back whole (many websocket messages each way)
        reader, writer = first
        blob = bytes(range(97, 123)) * 40_000  # ~1 MB of a-z
        writer.write(blob)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(len(blob)), 60) == blob.upper()
        for _, w in (first, second):
            w.close()


async def test_a_v4_client_gets_the_port_header_the_data_and_the_end_of_the_connection(
    kube_ns: Kube, ws_core: client.CoreV1Api
) -> None:
    name, _ip = await asyncio.to_thread(_echo_pod, kube_ns)
    resp = await ws_core.connect_get_namespaced_pod_portforward(
        name, kube_ns.ns, ports="7002", _preload_content=False
    )
    got: dict[int, list[bytes]] = {}
    async with resp as ws:
        async for msg in ws:  # the server says hello and closes: the websocket ends with it
            got.setdefault(msg.data[0], []).append(msg.data[1:])
    port = struct.pack("<H", 7002)
    assert got[0][0] == port and got[1] == [port], got
    assert b"".join(got[0][1:]).startswith(b"hello from "), got

    # a port nothing listens on: the kubelet's error on the port's error channel
    resp = await ws_core.connect_get_namespaced_pod_portforward(
        name, kube_ns.ns, ports="7009", _preload_content=False
    )
    got = {}
    async with resp as ws:
        async for msg in ws:
            got.setdefault(msg.data[0], []).append(msg.data[1:])
    error = b"".join(got[1][1:]).decode()
    assert error.startswith(f"error forwarding port 7009 to pod {name}, uid "), got
    assert "Connection refused" in error, error
    assert got[0] == [struct.pack("<H", 7009)], got


async def test_a_refused_forward_says_why(kube_ns: Kube, ws_core: client.CoreV1Api) -> None:
    import aiohttp

    name, _ip = await asyncio.to_thread(_echo_pod, kube_ns)
    for pod, ports, status in ((name, "http", 400), ("no-such-pod", "80", 404)):
        resp = await ws_core.connect_get_namespaced_pod_portforward(
            pod, kube_ns.ns, ports=ports, _preload_content=False
        )
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with resp:
                pass
        assert refused.value.status == status, (pod, ports, refused.value)
