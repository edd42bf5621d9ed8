"""DevCluster: etcd + kube-apiserver + kube-scheduler + kube-controller-manager + kube-proxy +
node agent, on a network of the cluster's own (`agent.podnet`).

Starting and stopping them; the state directory they live in (see `state`) and the calls that
talk to them are `state.ClusterState`'s.

The methods block (up() may build the binaries first: minutes, once per machine); from async
code call them in an executor, e.g. ``await asyncio.to_thread(cluster.up)``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from . import build, procs
from .addons import CONTROLLERS
from .agent import podnet
from .pki import KubeletPKI
from .spec import NodeSpec, default_nodes
from .state import COMPONENTS, STATE_ENTRIES, ClusterState, DevClusterError, default_state_dir

AGENT_MODULE = "gpulab.devcluster.agent"


class DevCluster(ClusterState):
    """A local Kubernetes control plane with simulated GPU nodes.

    >>> cluster = DevCluster(state_dir=tmp)        # or DevCluster.default()
    >>> cluster.up(nodes=[NodeSpec("gpu-0", gpus=8)])
    >>> cluster.kubeconfig                         # Path to pass to any Kubernetes client
    >>> cluster.stop_node("gpu-0"); cluster.start_node("gpu-0")
    >>> cluster.down()
    """

    @classmethod
    def default(cls, **kw: Any) -> DevCluster:
        return cls(default_state_dir(), **kw)

    # -- up ---------------------------------------------------------------------------------

    def up(
        self,
        nodes: list[NodeSpec] | None = None,
        *,
        timeout: float = 180.0,
        retry_ports: bool = True,
    ) -> DevCluster:
        """Start everything (building the binaries first if the cache lacks them).

        Idempotent: when the cluster already runs it is left alone (a different node list is an
        error; down() first). Returns self.
        """
        nodes = default_nodes() if nodes is None else list(nodes)
        if self.is_up():
            running = self._read_state().get("nodes", [])
            if running != [n.to_dict() for n in nodes]:
                raise DevClusterError(
                    f"the dev cluster in {self.state_dir} already runs with nodes "
                    f"{[n['name'] for n in running]}, not {[n.name for n in nodes]}; "
                    "run 'gpulab dev-cluster down' first"
                )
            self.log(f"already running (kubeconfig {self.kubeconfig})")
            return self
        if self._procs():
            self.log("a previous dev cluster is partly running; stopping it first")
            self.down()
        bins = build.ensure_binaries()
        build.ensure_system_packages(build.missing_system_packages(build.RUNTIME_PACKAGES))
        etcd = str(bins["etcd"])
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # root's alone: the kubeconfig and cluster.json hold a cluster-admin token, and pods run
        # as other uids (runAsUser) on this machine's file system
        self.state_dir.chmod(0o700)
        self._clean_data()
        t0 = time.monotonic()
        deadline = t0 + timeout
        state: dict[str, Any] = {
            "token": secrets.token_hex(24),
            "kube_proxy_token": secrets.token_hex(24),
            "ports": {
                k: procs.free_port()
                for k in ("etcd", "etcd_peer", "apiserver", "scheduler", "controller_manager")
            },
            "procs": {},
            "nodes": [n.to_dict() for n in nodes],
            "timing": asdict(self.timing),
        }
        self._write_state(state)
        try:
            self._make_network(state, len(nodes))
            self._start_control_plane(state, bins, etcd, deadline)
            # the nodes first: kube-proxy (1.29+) exits when its Node's addresses change, and a
            # Node registered after it starts is such a change
            self._start_agent(state, nodes, deadline)
            self._start_kube_proxy(state, bins, nodes, deadline)
        except DevClusterError as e:
            self.log("start failed; stopping what was started")
            self.down(purge=False)
            if "address already in use" in str(e) and retry_ports:
                self.log("a port was taken meanwhile; starting again with other ports")
                return self.up(nodes, timeout=timeout, retry_ports=False)
            raise
        except BaseException:
            self.log("start failed; stopping what was started")
            self.down(purge=False)
            raise
        self.log(
            f"up in {time.monotonic() - t0:.1f} s: API {self.api_url}, "
            f"{len(nodes)} node(s), kubeconfig {self.kubeconfig}"
        )
        return self

    def _clean_data(self, *, logs: bool = True) -> None:
        for name in STATE_ENTRIES:
            p = self.state_dir / name
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()
        if logs:
            shutil.rmtree(self.state_dir / "logs", ignore_errors=True)
            (self.state_dir / "logs").mkdir(parents=True)

    def _start(self, state: dict[str, Any], name: str, argv: list[str], **kw: Any) -> None:
        p = procs.launch(name, argv, self.state_dir / "logs" / f"{name}.log", **kw)
        state["procs"][name] = p.to_dict()
        self._write_state(state)

    def _start_control_plane(
        self, state: dict[str, Any], bins: dict[str, Path], etcd: str, deadline: float
    ) -> None:
        d, ports, t = self.state_dir, state["ports"], self.timing
        sec = d / "secrets"
        sec.mkdir(mode=0o700)
        subprocess.run(
            ["openssl", "genrsa", "-out", str(sec / "sa.key"), "2048"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["openssl", "rsa", "-in", str(sec / "sa.key"), "-pubout", "-out", str(sec / "sa.pub")],
            check=True,
            capture_output=True,
        )
        # kube-proxy as in kubeadm's clusters: user system:kube-proxy, whom the bootstrap
        # ClusterRoleBinding system:node-proxier lets watch Services and EndpointSlices only
        (sec / "tokens.csv").write_text(
            f"{state['token']},admin,admin,system:masters\n"
            f"{state['kube_proxy_token']},system:kube-proxy,kube-proxy\n"
        )
        kubelet_pki = self._kubelet_pki
        kubelet_pki.create()
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        self._start(
            state,
            "etcd",
            [
                etcd,
                "--name=gpulab-dev",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
                f"--initial-cluster=gpulab-dev=http://127.0.0.1:{ports['etcd_peer']}",
                "--unsafe-no-fsync",
            ],
        )
        self._wait("etcd", deadline, lambda: self._http_ok(f"{etcd_url}/health"))
        certs = d / "certs"
        self._start(
            state,
            "kube-apiserver",
            [
                str(bins["kube-apiserver"]),
                f"--etcd-servers={etcd_url}",
                # on this machine's address on the cluster's network: the `kubernetes`
                # Service's endpoint (pods reach it through kube-proxy, as in-cluster clients do)
                f"--bind-address={state['api_host']}",
                f"--advertise-address={state['api_host']}",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={certs}",
                f"--token-auth-file={sec / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={sec / 'sa.pub'}",
                f"--service-account-signing-key-file={sec / 'sa.key'}",
                f"--service-cluster-ip-range={podnet.service_cidr(state['network_octet'])}",
                "--allow-privileged=true",
                f"--default-not-ready-toleration-seconds={t.toleration_seconds}",
                f"--default-unreachable-toleration-seconds={t.toleration_seconds}",
                # logs, exec and attach go to the node's kubelet API: at its InternalIP (a node
                # name is no DNS name here), its serving certificate verified, the API server
                # proving itself with a client certificate the kubelet API requires
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--kubelet-certificate-authority={kubelet_pki.ca_cert}",
                f"--kubelet-client-certificate={kubelet_pki.client_cert}",
                f"--kubelet-client-key={kubelet_pki.client_key}",
            ],
        )
        self._write_kubeconfig(state)
        self._wait("kube-apiserver", deadline, lambda: self._api_ok("/readyz"))
        kc = str(self.kubeconfig)
        common = [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
        ]
        self._start(
            state,
            "kube-scheduler",
            [str(bins["kube-scheduler"]), *common, f"--secure-port={ports['scheduler']}"],
        )
        self._start(
            state,
            "kube-controller-manager",
            [
                str(bins["kube-controller-manager"]),
                *common,
                f"--secure-port={ports['controller_manager']}",
                f"--service-account-private-key-file={sec / 'sa.key'}",
                f"--root-ca-file={certs / 'apiserver.crt'}",
                "--controllers=*,-node-ipam-controller",
                f"--node-monitor-period={t.node_monitor_period_seconds}s",
                f"--node-monitor-grace-period={t.node_monitor_grace_seconds}s",
                f"--node-startup-grace-period={max(30, t.node_monitor_grace_seconds)}s",
            ],
        )
        self._wait(
            "default ServiceAccount (kube-controller-manager)",
            deadline,
            self._default_service_account_ready,
        )
        self._install_snapshot_api(deadline)

    def _install_snapshot_api(self, deadline: float) -> None:
        """The snapshot.storage.k8s.io/v1 CRDs and the gpulab-local VolumeSnapshotClass (the node
        agent is their snapshotter and driver)."""
        from .agent import snapshotapi

        for crd in snapshotapi.crds():
            try:
                self.api("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
            except urllib.error.HTTPError as e:
                if e.code != 409:
                    detail = e.read().decode(errors="replace")
                    raise DevClusterError(
                        f"installing CRD {crd['metadata']['name']}: {detail}"
                    ) from e

        names = [crd["metadata"]["name"] for crd in snapshotapi.crds()]
        self._wait(
            "VolumeSnapshot CRDs established", deadline, lambda: self.crds_established(names)
        )
        path = f"/apis/{snapshotapi.API_VERSION}/volumesnapshotclasses"

        def class_created() -> bool:
            try:
                self.api("POST", path, snapshotapi.snapshot_class())
            except urllib.error.HTTPError as e:
                return e.code == 409
            except (OSError, urllib.error.URLError):
                return False
            return True

        self._wait("VolumeSnapshotClass gpulab-local", deadline, class_created)

    def _make_network(self, state: dict[str, Any], node_count: int) -> None:
        """The cluster's network (`podnet`), before the API server, which listens there."""
        try:
            octet = podnet.NodeNetwork(self.state_dir / "agent", node_count).create()
        except RuntimeError as e:
            raise DevClusterError(f"the cluster's network: {e}") from e
        state["network_octet"] = octet
        state["api_host"] = podnet.host_address(octet)
        self._write_state(state)

    def _start_kube_proxy(
        self, state: dict[str, Any], bins: dict[str, Path], nodes: list[NodeSpec], deadline: float
    ) -> None:
        """kube-proxy (iptables mode) in the nodes' network namespace: one for all the
        simulated nodes, since they share that namespace (a real cluster runs one per node, in
        each node's). Its health port is on the uplink's inner address, where `up` waits for
        its first sync of the rules (`/livez`: `/healthz` also wants its Node, which the agent
        registers after it)."""
        octet = state["network_octet"]
        kubeconfig = self.state_dir / "kube-proxy.kubeconfig"
        self._write_kubeconfig(state, kubeconfig, token_key="kube_proxy_token")
        state["ports"]["kube_proxy_health"] = procs.free_port()
        health = f"{podnet.uplink_address(octet)}:{state['ports']['kube_proxy_health']}"
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "clusterCIDR": str(podnet.pod_network(octet)),
            "hostnameOverride": nodes[0].name if nodes else "gpulab-dev",
            "bindAddress": podnet.uplink_address(octet),
            "healthzBindAddress": health,
            "metricsBindAddress": "127.0.0.1:10249",
            # NodePorts on the nodes' addresses (all in the pod network), not the uplink's
            "nodePortAddresses": [str(podnet.pod_network(octet))],
            # the conntrack table's size is the machine's (a module parameter): leave it
            "conntrack": {"maxPerCore": 0},
            "oomScoreAdj": 0,
        }
        config_file = self.state_dir / "kube-proxy.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self._start(
            state,
            "kube-proxy",
            ["ip", "netns", "exec", podnet.nodes_netns(octet), str(bins["kube-proxy"]),
             f"--config={config_file}"],
        )  # fmt: skip
        self._wait("kube-proxy", deadline, lambda: self._http_ok(f"http://{health}/livez"))

    def _start_agent(self, state: dict[str, Any], nodes: list[NodeSpec], deadline: float) -> None:
        agent_dir = self.state_dir / "agent"
        agent_dir.mkdir()
        nodes_file = self.state_dir / "nodes.json"
        nodes_file.write_text(json.dumps([n.to_dict() for n in nodes], indent=2))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # pods find this environment's commands (jupyterhub-singleuser...) on their PATH, after
        # any folders the cluster was given for them
        env["PATH"] = os.pathsep.join(
            [
                *map(str, self.pod_bin_dirs),
                str(Path(sys.executable).parent),
                env.get("PATH", "/usr/bin:/bin"),
            ]
        )
        self._start(
            state,
            "agent",
            [
                sys.executable,
                "-m",
                AGENT_MODULE,
                f"--kubeconfig={self.kubeconfig}",
                f"--state-dir={agent_dir}",
                f"--nodes-file={nodes_file}",
                f"--heartbeat-seconds={self.timing.heartbeat_seconds}",
                f"--kubelet-pki={self._kubelet_pki.folder}",
            ],
            env=env,
        )
        names = {n.name for n in nodes}
        self._wait("node agent", deadline, lambda: (agent_dir / "control.json").exists())
        self._wait(f"nodes {sorted(names)} Ready", deadline, lambda: self._nodes_ready(names))

    @property
    def _kubelet_pki(self) -> KubeletPKI:
        return KubeletPKI(self.state_dir / "secrets" / "kubelet")

    # -- nodes ------------------------------------------------------------------------------

    def nodes(self) -> dict[str, Any]:
        """The agent's view: {node: {"running": bool, "pods": [...]}}."""
        return dict(self._agent("GET", "/nodes"))

    @property
    def host_address(self) -> str:
        """This machine's address on the cluster's pod network: where pods reach a process that
        runs here outside the cluster (a hub: listen there or on 0.0.0.0, and tell pods this
        address), and the source address of this machine's connections to pods (what a
        NetworkPolicy's ipBlock for such a hub names). Pods cannot reach 127.0.0.1 of the host:
        that is their own network namespace's."""
        return podnet.host_address(podnet.cluster_octet(self.state_dir / "agent"))

    @property
    def pod_network(self) -> str:
        """The cluster's pod network (CIDR): its pods and nodes and, at its first address, this
        machine."""
        return str(podnet.pod_network(podnet.cluster_octet(self.state_dir / "agent")))

    def stop_node(self, name: str) -> None:
        """Simulate a node failure: stop heartbeats of node `name` and kill its pods' processes.

        The API is not told; the node controller marks the node NotReady after
        timing.node_monitor_grace_seconds and evicts its pods after timing.toleration_seconds.
        """
        self._agent("POST", f"/nodes/{name}/stop")

    def start_node(self, name: str) -> None:
        """Bring a stopped node back: heartbeats resume and the unreachable taints are removed."""
        self._agent("POST", f"/nodes/{name}/start")

    def logs(self, pod: str, namespace: str = "default", container: str | None = None) -> str:
        """A container's output (stdout + stderr) since its last start, as `kubectl logs`
        prints it; "" when there is none (all containers' when `container` is None).

        The file lives until the pod is deleted: STATE/agent/pods/NS_POD_UID/CONTAINER.log, in
        the CRI log format (agent/crilog.py); the run before a restart is CONTAINER.log.previous.
        """
        from .agent import crilog

        dirs = sorted((self.state_dir / "agent" / "pods").glob(f"{namespace}_{pod}_*"))
        if not dirs:
            return ""
        files = sorted(dirs[-1].glob(f"{container or '*'}.log"))
        return "".join(crilog.plain(f.read_bytes()).decode(errors="replace") for f in files)

    # -- down -------------------------------------------------------------------------------

    def down(self, *, purge: bool = True) -> list[str]:
        """Stop every process this cluster started (SIGTERM, then SIGKILL); returns their names.

        purge removes the cluster's data (etcd, volumes, kubeconfig) but keeps logs/.
        """
        found = self._procs()
        stopped: list[str] = []
        for name in COMPONENTS:
            if name in found:
                stopped += procs.stop([found[name]], grace_seconds=10 if name == "agent" else 5)
        marker = str(self.state_dir) + os.sep
        # Kueue and JobSet (batch.py) too, where a killed test left them running
        names = ("launcher.py", AGENT_MODULE, "kube-", "etcd", *(c.binary for c in CONTROLLERS))
        strays = procs.stray_processes(marker, names)
        if strays:
            stopped += procs.stop(strays, grace_seconds=2)
        from .agent import clusterdns
        from .agent.runtime import remove_recorded

        remove_recorded(self.state_dir / "agent" / "host-paths.json")
        # what a killed agent (SIGKILL skips its own cleanup) left: found by name
        octet = podnet.cluster_octet(self.state_dir / "agent")
        dns_records = clusterdns.records_dir(octet)
        stray_dns = procs.stray_processes(f"{dns_records}/", ("dnsmasq",))
        if stray_dns:
            stopped += procs.stop(stray_dns, grace_seconds=2)
        shutil.rmtree(dns_records, ignore_errors=True)
        podnet.remove_leftovers(octet)
        if purge:
            self._clean_data(logs=False)
        elif self._state_file.exists():
            state = self._read_state()
            state["procs"] = {}
            self._write_state(state)
        return stopped

    def __enter__(self) -> DevCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
