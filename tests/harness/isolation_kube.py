"""The cross-user attack catalogue on Kubernetes: what an attacker's kernel in her pod on the dev
cluster tries against another user's pod, volume and key, the node, the control plane and the cloud
metadata address (GPUKubeSpawner's NetworkPolicy and pod hardening must refuse each); the shared
token, REST, input and confused-deputy attempts of `tests.harness.isolation` run here too."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpulab.devcluster import DevCluster
from gpulab.devcluster.agent import podnet
from gpulab.spawner.names import DASK_CLUSTER_LABEL, PUSH_URL_ENV
from gpulab.spawner.workspaces.kube import KEY_FILE as CHECKPOINT_KEY_FILE
from tests.harness.hub import Hub, run_in_kernel
from tests.harness.isolation import (
    ATTACKER,
    PROBE_READS,
    VICTIM,
    Attempt,
    api_attacks,
    deputy_attacks,
    fifo_deputy_attacks,
    input_attacks,
    prepare_victim,
    server_token_attacks,
)
from tests.harness.isolation_dask import (
    listening_sockets,
    outcome,
    probe_code,
    start_victim_cluster,
    stop_victim_cluster,
)

# -- Kubernetes (GPUKubeSpawner on the dev cluster) ------------------------------------------------

#: where Kubernetes would mount a pod's service-account token (automount)
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
#: the cloud metadata address; the kube suite serves it on this machine (metadata_endpoint), so
#: that a pod's connection would succeed were the NetworkPolicy's `except` missing
CLOUD_METADATA = ("169.254.169.254", 80)

# Runs in the attacker's kernel in her pod: the visible processes (any of the victim's, any of the
# node's: the hub, the control plane) and a TCP connection to each target.
KUBE_PROBE = (
    PROBE_READS
    + """
victims, foreign = [], []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        environ = b""
    if VICTIM_MARKER.encode() in environ or VICTIM_MARKER.encode() in cmdline:
        victims.append(pid)
    if any(m.encode() in cmdline for m in NODE_MARKERS):
        foreign.append(pid)
results["see the victim's processes"] = f"allowed {victims}" if victims else "denied"
results["see the node's processes"] = f"allowed {foreign}" if foreign else "denied"
def signal_victim():
    # a pid is a number in the reader's own PID namespace: only a victim's process counts
    environ = open(f"/proc/{VICTIM_PID}/environ", "rb").read()
    if VICTIM_MARKER.encode() not in environ:
        raise PermissionError("not the victim's")
    os.kill(VICTIM_PID, 0)
results["signal the victim's server by its node pid"] = attempt(signal_victim)
for name, (host, port) in CONNECT.items():
    def connect():
        socket.create_connection((host, port), timeout=5).close()
    outcome = attempt(connect)
    results[name] = "denied" if outcome in ("ConnectionRefusedError", "ConnectionResetError",
                                            "TimeoutError") else outcome
for name, path in CONTROL_READS.items():
    results[name] = attempt(lambda: open(path, "rb").read(1))
for name, (host, port) in CONTROL_CONNECT.items():
    results[name] = attempt(lambda: socket.create_connection((host, port), timeout=5).close())
print(json.dumps(results))
"""
)


def _pod_of(cluster: DevCluster, user: str) -> dict[str, Any]:
    pods = cluster.api("GET", "/api/v1/namespaces/default/pods")["items"]
    (pod,) = [
        p
        for p in pods
        if (p["metadata"].get("annotations") or {}).get("hub.jupyter.org/username") == user
        and not p["metadata"].get("deletionTimestamp")
    ]
    return pod


def _volume_of(cluster: DevCluster, pod: dict[str, Any]) -> Path:
    """The node's folder of the pod's home claim (a gpulab-local PV is a hostPath)."""
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "gpulab-home"]
    claim = vol["persistentVolumeClaim"]["claimName"]
    pvc = cluster.api("GET", f"/api/v1/namespaces/default/persistentvolumeclaims/{claim}")
    pv = cluster.api("GET", f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
    return Path(pv["spec"]["hostPath"]["path"])


def _pod_dir(cluster: DevCluster, pod: dict[str, Any]) -> Path:
    meta = pod["metadata"]
    return cluster.state_dir / "agent" / "pods" / f"default_{meta['name']}_{meta['uid'][:8]}"


def _host_pids_of(user: str) -> list[int]:
    """This machine's pids of the user's server processes (their environments name the user)."""
    marker = f"\0JUPYTERHUB_USER={user}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in b"\0" + (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return sorted(pids)


def _descendants(root: int) -> set[int]:
    """`root` and every process below it (the hub: its proxy and its managed services)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _listening_ports(pids: set[int]) -> set[int]:
    """TCP ports on which the processes `pids` listen."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    ports = set()
    for table_path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table_path).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def metadata_endpoint() -> Iterator[None]:
    """Serve TCP at the cloud metadata address on this machine (an address on `lo`, removed
    afterwards when this added it), as a cloud would: a probe that finds nothing there proves
    nothing. Needs root."""
    host, port = CLOUD_METADATA
    added = False
    if (
        f"{host}/32"
        not in subprocess.run(
            ["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=True
        ).stdout
    ):
        subprocess.run(["ip", "addr", "add", f"{host}/32", "dev", "lo"], check=True)
        added = True
    server = socket.create_server((host, port))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.5)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        server.close()
        if added:
            subprocess.run(["ip", "addr", "del", f"{host}/32", "dev", "lo"], check=False)


def _ports_servers_call(pod: dict[str, Any]) -> set[int]:
    """The hub-side ports a server is told to call (the hub API, the metrics push), from its pod's
    environment: what the servers' NetworkPolicy lets it reach on the hub."""
    env = {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}
    urls = [env["JUPYTERHUB_API_URL"], env[PUSH_URL_ENV]]
    return {int(urlsplit(url).port or 80) for url in urls}


async def kube_kernel_attacks(hub: Hub, cluster: DevCluster) -> list[Attempt]:
    """From inside the attacker's kernel in her pod: the victim's volume, key, checkpoint, snapshot
    and log where the node keeps them, the hub's and the cluster's secrets, the service-account
    token, the victim's processes, and connections to everything a pod must not reach. Every
    target is first shown to exist (and every address to answer) from outside the pod."""
    victim_pod, attacker_pod = _pod_of(cluster, VICTIM), _pod_of(cluster, ATTACKER)
    volume, pod_dir = _volume_of(cluster, victim_pod), _pod_dir(cluster, victim_pod)
    state, agent = hub.state_dir, cluster.state_dir / "agent"
    victim_snapshots = [p for p in (agent / "snapshots").rglob("diary.txt")]
    reads = {
        "victim's file on the node": str(volume / "diary.txt"),
        "victim's checkpoint on the node": str(
            next((volume / ".gpulab" / "checkpoints").rglob("manifest.json"), "no checkpoint")
        ),
        "victim's key file on the node": str(pod_dir / "volumes" / "gpulab-checkpoint-key" / "key"),
        "victim's snapshot on the node": str(victim_snapshots[0] if victim_snapshots else "none"),
        "victim's container log": str(next(pod_dir.glob("*.log"), "no log")),
        "hub database": str(state / "jupyterhub.sqlite"),
        "hub cookie secret": str(state / "jupyterhub_cookie_secret"),
        "hub checkpoint secret": str(state / "gpulab-checkpoint-secret"),
        # (no allocations database: on Kubernetes placements live in pod annotations)
        "initial admin password": str(state / "initial-admin-password"),
        "cluster kubeconfig (cluster-admin token)": str(cluster.kubeconfig),
        "cluster state (cluster-admin token)": str(cluster.state_dir / "cluster.json"),
        "API server token file": str(cluster.state_dir / "secrets" / "tokens.csv"),
        "service-account signing key": str(cluster.state_dir / "secrets" / "sa.key"),
        "agent control address": str(agent / "control.json"),
        # the kubelet API runs exec in any pod for whoever holds these (see agent/kubeletapi.py)
        "kubelet CA key": str(cluster.state_dir / "secrets" / "kubelet" / "ca.key"),
        "API server's kubelet client key": str(
            cluster.state_dir / "secrets" / "kubelet" / "apiserver-kubelet-client.key"
        ),
        "node's kubelet serving key": str(
            agent / "pki" / f"{attacker_pod['spec']['nodeName']}.key"
        ),
    }
    missing = [name for name, path in reads.items() if not Path(path).is_file()]
    assert not missing, f"the probe's targets must exist to prove anything: {missing}"
    # the attacker's pod reads the key at the mount path: her own, never the victim's (they differ)
    listings = {
        "list the victim's volume on the node": str(volume),
        "list all pods' folders": str(agent / "pods"),
        "list all volumes": str(agent / "volumes"),
        "list the cluster's etcd data": str(cluster.state_dir / "etcd"),
        "list the hub's state": str(state),
    }
    # the token Kubernetes would mount: the API server gives every pod of the namespace's default
    # ServiceAccount a projected token (TokenRequest), so only automountServiceAccountToken:
    # false keeps it out of the pod
    default_sa = cluster.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
    assert default_sa["metadata"]["name"] == "default", "no default ServiceAccount to mount"
    reads["service-account token"] = SERVICE_ACCOUNT_TOKEN

    victim_ip = victim_pod["status"]["podIP"]
    cluster_state = json.loads((cluster.state_dir / "cluster.json").read_text())
    control = json.loads((agent / "control.json").read_text())
    # A pod has a network namespace of its own: the host's 127.0.0.1 is out of its reach, so it
    # tries the host's services where it can reach the host, at the host's address on the
    # cluster's network, and the nodes' services at their addresses (its node's kubelet API,
    # kube-proxy's health port). Each target is first shown to answer from outside the pod, on
    # any of the host's addresses (most listen on 127.0.0.1 only).
    host = cluster.host_address
    kube_proxy_health = (
        podnet.uplink_address(cluster_state["network_octet"]),
        cluster_state["ports"]["kube_proxy_health"],
    )
    # a service of this machine on every address (as a node's sshd or node-exporter would be):
    # what only the NetworkPolicy keeps pods from
    every_address = socket.create_server(("0.0.0.0", 0))
    any_port = int(every_address.getsockname()[1])
    connect: dict[str, tuple[str, int]] = {
        "victim's server": (victim_ip, 8888),
        "cloud metadata 169.254.169.254:80": CLOUD_METADATA,
        "Kubernetes API server": (host, cluster_state["ports"]["apiserver"]),
        "etcd (every Secret, unauthenticated)": (host, cluster_state["ports"]["etcd"]),
        "node agent control API": (host, control["port"]),
        "a host service on every address, at the host address": (host, any_port),
        "kube-proxy's health port, on the nodes' network": kube_proxy_health,
        # exec into any pod, were it not for the NetworkPolicy and the client certificate it needs
        "her node's kubelet API": (attacker_pod["status"]["hostIP"], 10250),
    }
    assert hub.proc is not None
    # the API and the metrics push are what servers must reach; the public address answers
    # everyone (and asks who they are), so reaching it is no leak
    allowed = _ports_servers_call(victim_pod) | {hub.port}
    for port in sorted(_listening_ports(_descendants(hub.proc.pid)) - allowed):
        connect[f"hub-side port {port} (not the API)"] = (host, port)
    assert hub.proxy_api_port in {p for _, p in connect.values()}, "the proxy's API is a target"
    closed = [
        name
        for name, (address, port) in connect.items()
        if not (_reachable(address, port) or _reachable("127.0.0.1", port))
    ]
    assert not closed, f"the probe's addresses must answer from outside to prove anything: {closed}"

    victim_pids = _host_pids_of(VICTIM)
    assert victim_pids, "the victim's server must run on this machine"
    # controls, not attempts: the same probe reads the attacker's own key and reaches the hub API,
    # so a refusal is the isolation's and not that of a probe that can do nothing at all
    control_reads = {"control: own key": CHECKPOINT_KEY_FILE}
    control_connect = {"control: the hub API": (host, hub.hub_port)}
    code = (
        f"READS = {reads!r}\nLISTINGS = {listings!r}\nCONNECT = {connect!r}\n"
        f"VICTIM_MARKER = {'JUPYTERHUB_USER=' + VICTIM!r}\nVICTIM_PID = {victim_pids[0]!r}\n"
        f"NODE_MARKERS = {['jupyterhub_config', 'kube-apiserver', 'etcd']!r}\n"
        f"CONTROL_READS = {control_reads!r}\nCONTROL_CONNECT = {control_connect!r}\n" + KUBE_PROBE
    )
    try:
        out = await run_in_kernel(hub, ATTACKER, code)
    finally:
        every_address.close()
    results = json.loads(out.splitlines()[-1])
    controls = {name: results.pop(name) for name in [*control_reads, *control_connect]}
    assert set(controls.values()) == {"allowed"}, f"the probe cannot work: {controls}"

    def category(name: str) -> str:
        if name in connect:
            return "kube:network"
        if name.startswith(("victim's", "list the victim's", "list all")):
            return "kube:files"
        if name.startswith(("see", "signal")):
            return "kube:processes"
        if name.startswith(("hub", "allocations", "initial", "list the hub")):
            return "kube:hub secrets"
        return "kube:cluster secrets"

    return [
        Attempt(
            category(name),
            name,
            "refused" if result in ("denied", "missing") else "leak",
            result,
        )
        for name, result in results.items()
    ]


async def kube_attack_suite(hub: Hub, cluster: DevCluster, profile: str = "cpu") -> list[Attempt]:
    """Every attempt of the catalogue against a hub with GPUKubeSpawner on the dev cluster, inside
    `metadata_endpoint()`; the categories are prefixed "kube:"."""
    victim = await prepare_victim(hub, profile=profile)
    attempts = await kube_kernel_attacks(hub, cluster)
    shared = await server_token_attacks(hub)
    shared += await api_attacks(hub, victim)
    shared += await input_attacks(hub, victim)
    shared += await fifo_deputy_attacks(hub, victim)
    # the node's snapshotter (root) copies the attacker's volume: it must keep a link a link
    shared += await deputy_attacks(
        hub,
        target=cluster.kubeconfig,
        snapshot_root=cluster.state_dir / "agent",  # snapshot trees and the restored volume
        profile=profile,
    )
    attempts += await kube_dask_attacks(hub, cluster)
    return attempts + [Attempt(f"kube:{a.category}", a.name, a.outcome, a.detail) for a in shared]


def _pids_in_pod_network(ip: str) -> list[int]:
    """This machine's pids in the network namespace of the pod with address `ip` (the pod's
    processes: the node agent runs them here, each pod in a namespace of its own). Found by the
    namespace, not by environment or command line: distributed's processes retitle themselves,
    which overwrites what /proc shows of both."""
    try:
        want = os.stat(podnet.NETNS_DIR / podnet.pod_link_name(ip)).st_ino
    except OSError:
        return []
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(proc / "ns" / "net").st_ino == want:
                    pids.append(int(proc.name))
    return pids


async def kube_dask_attacks(hub: Hub, cluster: DevCluster) -> list[Attempt]:
    """The victim's Dask cluster on Kubernetes (its scheduler's and worker's pods, made by the
    dask-kubernetes operator) against the attacker's kernel in her pod: every port the cluster's
    processes listen on, at each pod's address (tests/harness/isolation_dask.py). The clusters'
    NetworkPolicy must refuse the connections before TLS is tried. It needs the dask operator
    running (`tests.harness.dask_kube.running_dask_operator`)."""
    dask_cluster = start_victim_cluster(hub, VICTIM)
    try:
        selector = f"{DASK_CLUSTER_LABEL}={dask_cluster['id']},hub.jupyter.org/username={VICTIM}"
        pods = cluster.api("GET", f"/api/v1/namespaces/default/pods?labelSelector={selector}")[
            "items"
        ]
        targets: list[tuple[str, str, int, bool]] = []
        # a listener on another address than its pod's (every interface: distributed's default
        # for a worker's HTTP server) is a leak of its own, whatever the NetworkPolicy stops
        elsewhere: list[Attempt] = []
        for pod in pods:
            ip = pod["status"]["podIP"]
            role = pod["metadata"]["labels"].get("dask.org/component", "dask")
            # what the pod's processes listen on, from their own tables
            bound = sorted(listening_sockets(_pids_in_pod_network(ip)))
            for address, port in bound:
                targets.append(
                    (f"{role} pod {ip} port {port} (bound to {address})", ip, port, False)
                )
            others = [f"{a}:{p}" for a, p in bound if a != ip]
            elsewhere.append(
                Attempt(
                    "kube:dask",
                    f"her {role} pod listens beside its own address {ip}",
                    "leak" if others or not bound else "refused",
                    f"also on {', '.join(others)}" if others else f"{len(bound)} listener(s)",
                )
            )
        assert len(targets) >= 5, f"the victim's Dask pods must listen to prove anything: {targets}"
        closed = [t for t in targets if not _reachable(t[1], t[2])]
        assert not closed, (
            f"the probe's addresses must answer from outside to prove anything: {closed}"
        )
        out = await run_in_kernel(hub, ATTACKER, probe_code(targets), timeout=300)
        results = json.loads(out.splitlines()[-1])
    finally:
        stop_victim_cluster(hub, VICTIM, dask_cluster)
    return elsewhere + [
        Attempt("kube:dask", f"her pod, {name}", outcome(result), result)
        for name, result in results.items()
    ]
