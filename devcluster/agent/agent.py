"""The node agent: simulated nodes (heartbeats + pods), the volume provisioner and snapshotter,
a control API.

Control API (loopback HTTP, port in STATE/control.json):
    GET  /nodes               {node: {"running": bool, "ip": ..., "pods": [...]}}
    POST /nodes/NAME/stop     simulate a node failure: heartbeats stop, its pods' processes die
    POST /nodes/NAME/start    the node comes back
SIGTERM/SIGINT stop the agent the way a machine failure would: every pod process is killed and the
API is told nothing (the node controller then marks the nodes NotReady).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from ..pki import KubeletPKI
from ..spec import NodeSpec
from . import clusterdns, netpolicy, podnet, serviceenv
from .devices import Devices
from .kube import Events, api_client, log, watch_forever
from .kubeletapi import KUBELET_PORT, KubeletServer, server_context
from .nodes import NodeHeartbeat
from .pods import PodManager
from .podstate import IPPool, NodeContext
from .runtime import HostPaths
from .snapshots import SnapshotController
from .volumes import Provisioner


class SimulatedNode:
    def __init__(self, agent: Agent, spec: NodeSpec, index: int) -> None:
        self.agent, self.spec = agent, spec
        # the node's one address (InternalIP, hostIP, its pods' gateway): an address of the host
        self.ip = podnet.node_address(agent.octet, index)
        pod_cidr = podnet.node_pod_cidr(agent.octet, index)
        self.heartbeat = NodeHeartbeat(
            agent.api,
            spec,
            internal_ip=self.ip,
            pod_cidr=pod_cidr,
            interval_seconds=agent.heartbeat,
        )
        from .. import spec as nodespec

        self.ctx = NodeContext(
            name=spec.name,
            host_ip=self.ip,
            core=client.CoreV1Api(agent.api),
            events=Events(client.CoreV1Api(agent.api)),
            ips=IPPool(pod_cidr.rsplit(".", 1)[0]),
            host_paths=agent.host_paths,
            pods_dir=agent.state_dir / "pods",
            capacity=nodespec.capacity(spec),
            base_env=agent.base_env,
            devices=Devices(spec),
            netpol=agent.netpol,
            network=agent.network,
            dns_server=agent.dns_address,
            services=agent.services,
        )
        self.pods = PodManager(self.ctx)
        self.kubelet = KubeletServer(spec.name, self.pods)
        #: TLS of the node's kubelet API (None: no kubelet API, the agent has no CA)
        self.kubelet_tls: ssl.SSLContext | None = None
        self.tasks: list[asyncio.Task[Any]] = []

    @property
    def running(self) -> bool:
        return bool(self.tasks)

    def start(self) -> None:
        if not self.tasks:
            self.tasks = [
                asyncio.create_task(self.heartbeat.run()),
                asyncio.create_task(self.pods.run()),
                asyncio.create_task(self._serve_kubelet()),
            ]

    async def _serve_kubelet(self) -> None:
        """The kubelet API while the node runs (a stopped node answers nothing, as a failed
        machine), at the address the Node reports."""
        if self.kubelet_tls is None:
            return
        try:
            sock = await asyncio.to_thread(self.agent.network.listen, self.ip, KUBELET_PORT)
            await self.kubelet.start(sock, self.kubelet_tls)
        except OSError as e:
            log.error(
                "node %s: no kubelet API on %s:%d: %s", self.spec.name, self.ip, KUBELET_PORT, e
            )
            return
        try:
            await asyncio.Event().wait()
        finally:
            await self.kubelet.stop()

    async def stop(self) -> None:
        tasks, self.tasks = self.tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pods.kill_all()


class Agent:
    def __init__(
        self,
        kubeconfig: str,
        state_dir: Path,
        nodes: list[NodeSpec],
        heartbeat: float,
        *,
        kubelet_pki: KubeletPKI | None = None,
    ) -> None:
        self.kubelet_pki = kubelet_pki
        self.kubeconfig, self.state_dir, self.specs, self.heartbeat = (
            kubeconfig,
            state_dir,
            nodes,
            heartbeat,
        )
        # the cluster's network: DevCluster.up made it (the uplink's alias names this folder)
        self.octet = podnet.cluster_octet(state_dir)
        self.network = podnet.PodNetwork(self.octet)
        self.services = serviceenv.ServiceLister()
        self.host_paths = HostPaths(state_dir / "host-paths.json")
        self.nodes: dict[str, SimulatedNode] = {}
        self.base_env: dict[str, str] = {}
        self.api: client.ApiClient
        self.netpol: netpolicy.Enforcer | None = None
        #: why NetworkPolicies are not enforced (None: they are)
        self.netpol_off: str | None = None
        #: the cluster's DNS server (None: none runs; pods keep the host's resolv.conf)
        self.dns: clusterdns.ClusterDNS | None = None
        self.dns_address: str | None = None
        self.dns_watch: asyncio.Future[Any]

    def _base_env(self) -> dict[str, str]:
        """What every container gets beside the pod's own and the Services' variables
        (KUBERNETES_SERVICE_HOST among them, `serviceenv`): the agent's PATH (pods run this
        machine's commands) and locale."""
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
        }

    async def run(self) -> None:
        # one pod watch per node and four for the provisioner and snapshotter stay open; heartbeats need a few more
        self.api = await api_client(self.kubeconfig, connections=2 * len(self.specs) + 40)
        self.base_env = self._base_env()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for private in ("pods", "volumes", "snapshots"):
            # the agent's alone: pods run as other uids (runAsUser) on this machine's file system,
            # and must reach their volumes, keys and logs only where they are mounted in their own
            # mount namespace, never another pod's through these folders
            d = self.state_dir / private
            d.mkdir(exist_ok=True)
            d.chmod(0o700)
        await asyncio.to_thread(self.network.check)
        services = asyncio.ensure_future(self.services.run(client.CoreV1Api(self.api)))
        await self._start_cluster_dns()
        policies = await self._start_network_policies()
        for i, spec in enumerate(self.specs):
            self.nodes[spec.name] = SimulatedNode(self, spec, i)
        await self._kubelet_certificates()
        volumes, snapshot_store = self.state_dir / "volumes", self.state_dir / "snapshots"
        provisioner = asyncio.gather(
            Provisioner(self.api, volumes, snapshot_store).run(),
            SnapshotController(self.api, volumes, snapshot_store).run(),
        )
        for node in self.nodes.values():
            node.start()
        server = await asyncio.start_server(self._control, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        tmp = self.state_dir / "control.json.tmp"
        tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
        tmp.replace(self.state_dir / "control.json")
        log.info("node agent up: %d node(s), control API on 127.0.0.1:%d", len(self.nodes), port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("node agent stopping: killing all pod processes (the API sees a node failure)")
        server.close()
        provisioner.cancel()
        services.cancel()
        await asyncio.gather(*(n.stop() for n in self.nodes.values()), return_exceptions=True)
        with contextlib.suppress(BaseException):
            await provisioner
        if policies is not None:
            policies.cancel()
            with contextlib.suppress(BaseException):
                await policies
        if self.netpol is not None:
            await self.netpol.remove()
        if self.dns is not None:
            self.dns_watch.cancel()
            with contextlib.suppress(BaseException):
                await self.dns_watch
            await self.dns.stop()
        await self.api.close()

    async def _start_cluster_dns(self) -> None:
        """dnsmasq on this machine's address on the cluster's network, port 53, answering the
        cluster's names, behind the Service kube-system/kube-dns (its ClusterIP is what pods
        with dnsPolicy ClusterFirst get in their /etc/resolv.conf, as a kubelet's
        --cluster-dns). Without dnsmasq (or with port 53 taken there) pods keep the host's
        resolv.conf, and the log says why."""
        address = podnet.host_address(self.octet)
        logs = self.state_dir.parent / "logs"
        server = clusterdns.ClusterDNS(clusterdns.records_dir(self.octet), address)
        try:
            await server.start(
                logs / "dnsmasq.log" if logs.is_dir() else self.state_dir / "dnsmasq.log"
            )
        except (OSError, RuntimeError) as e:
            log.warning("no cluster DNS (pods keep the host's resolv.conf): %s", e)
            await server.stop()
            return
        self.dns = server
        core = client.CoreV1Api(self.api)
        self.dns_address = await self._publish_dns_service(core, address)
        self.dns_watch = asyncio.ensure_future(server.watch(core))

    async def _publish_dns_service(self, core: client.CoreV1Api, server: str) -> str:
        """The kube-dns Service (no selector: its Endpoints name the dnsmasq on this machine,
        whom the endpoint controller leaves alone and the mirroring controller copies into an
        EndpointSlice for kube-proxy); returns its ClusterIP."""
        ip, ns = podnet.dns_service_ip(self.octet), "kube-system"
        ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
        service = {
            "metadata": {"name": "kube-dns", "labels": {"k8s-app": "kube-dns"}},
            "spec": {
                "clusterIP": ip,
                "ports": [
                    {"name": n, "protocol": proto, "port": 53, "targetPort": 53}
                    for n, proto in ports
                ],
            },
        }
        endpoints = {
            "metadata": {"name": "kube-dns", "labels": {"k8s-app": "kube-dns"}},
            "subsets": [
                {
                    "addresses": [{"ip": server}],
                    "ports": [{"name": n, "protocol": proto, "port": 53} for n, proto in ports],
                }
            ],
        }
        for create, replace, body in (
            (core.create_namespaced_service, None, service),
            (
                core.create_namespaced_endpoints,
                core.replace_namespaced_endpoints,
                endpoints,
            ),
        ):
            try:
                await create(ns, body)
            except ApiException as e:
                if e.status != 409:
                    raise
                if replace is not None:
                    await replace("kube-dns", ns, body)
        return ip

    async def _kubelet_certificates(self) -> None:
        """Each node's serving certificate for the IP its Node object reports, signed by the
        cluster's kubelet CA (the API server verifies it)."""
        if self.kubelet_pki is None:
            log.warning("no kubelet CA given (--kubelet-pki): nodes serve no kubelet API")
            return
        pki_dir = self.state_dir / "pki"  # the nodes' keys: the agent's alone
        pki_dir.mkdir(mode=0o700, exist_ok=True)
        for node in self.nodes.values():
            key, cert = pki_dir / f"{node.spec.name}.key", pki_dir / f"{node.spec.name}.crt"
            await asyncio.to_thread(
                self.kubelet_pki.sign_serving, node.spec.name, node.ip, key, cert
            )
            node.kubelet_tls = server_context(self.kubelet_pki, cert, key)

    async def _start_network_policies(self) -> asyncio.Future[Any] | None:
        """One nft table for all the agent's pods, kept current from NetworkPolicies and
        Namespaces (their labels); without nft, policies are stored by the API server and not
        enforced, which the log says once."""
        self.netpol_off = netpolicy.unavailable_reason()
        if self.netpol_off:
            log.warning("NetworkPolicies are NOT enforced on this machine: %s", self.netpol_off)
            return None
        self.netpol = netpolicy.Enforcer(netns=self.network.netns)
        await self.netpol.apply()  # an empty table: refuses early when nft cannot load one
        networking, core = client.NetworkingV1Api(self.api), client.CoreV1Api(self.api)
        return asyncio.gather(
            watch_forever(
                "networkpolicies",
                networking.list_network_policy_for_all_namespaces,
                self.netpol.set_policy,
            ),
            watch_forever("namespaces", core.list_namespace, self.netpol.set_namespace),
        )

    # -- control API (tiny HTTP/1.0 server: no extra dependency) --------------------------------

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = (
                (await asyncio.wait_for(reader.readline(), 10)).decode(errors="replace").split()
            )
            while (await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b"\n", b""):
                pass
            code, body = await self._handle(*(request[:2] if len(request) >= 2 else ("", "")))
        except Exception as e:
            code, body = 500, {"error": str(e)}
        data = json.dumps(body).encode()
        writer.write(
            f"HTTP/1.0 {code} {'OK' if code == 200 else 'Error'}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        with contextlib.suppress(Exception):
            await writer.drain()
            writer.close()

    async def _handle(self, method: str, path: str) -> tuple[int, Any]:
        parts = [p for p in path.split("/") if p]
        if method == "GET" and parts == ["nodes"]:
            return 200, {
                name: {"running": n.running, "ip": n.ip, "pods": n.pods.pods()}
                for name, n in self.nodes.items()
            }
        if method == "GET" and parts == ["healthz"]:
            return 200, "ok"
        if method == "GET" and parts == ["network-policies"]:
            return 200, {"enforced": self.netpol is not None, "why_not": self.netpol_off}
        if (
            method == "POST"
            and len(parts) == 3
            and parts[0] == "nodes"
            and parts[2] in ("stop", "start")
        ):
            node = self.nodes.get(parts[1])
            if node is None:
                return 404, {
                    "error": f"no simulated node {parts[1]!r}; nodes: {sorted(self.nodes)}"
                }
            if parts[2] == "stop":
                await node.stop()
                log.info("node %s stopped (simulated failure)", node.spec.name)
            else:
                node.start()
                log.info("node %s started", node.spec.name)
            return 200, {"node": node.spec.name, "running": node.running}
        return 404, {"error": f"unknown request {method} {path}"}
