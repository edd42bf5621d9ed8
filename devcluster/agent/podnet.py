"""The pod network: the nodes' network namespace, and a network namespace per pod routed to it.

Address plan of one cluster (X = `address_octet(state_dir)`, 64..191, so A = X + 64 is 128..255;
another state dir's cluster has another A):

    10.A.0.0/16        the cluster's network, routed by this machine into the nodes' namespace
    10.A.0.0/17        its pods and nodes (kube-proxy's cluster CIDR)
    10.A.128.0/17      its Services' ClusterIPs (the API server's service CIDR)
    10.A.0.1           this machine as pods see it (the API server, a hub outside the cluster)
    10.A.0.2           the nodes' namespace's end of the uplink (kube-proxy's health port)
    10.A.N.0/24        node N's podCIDR (N = 1, 2, ... in the order of the nodes)
    10.A.N.1           node N's InternalIP (its kubelet API, its NodePorts, its pods' gateway)
    10.A.N.2-254       node N's pods

Like the machines of a real cluster, the simulated nodes have a network of their own: one
network namespace, `gdcX-nodes`, shared by all nodes of the cluster (one machine's nodes), that
holds the node addresses (on its `lo`), the kubelet API's sockets, kube-proxy with its iptables
rules, the NetworkPolicy table, and the host ends of the pods' veths. It reaches this machine
over a veth pair, the uplink: `gdcX-host` here (address 10.A.0.1; its alias names the state dir,
which is how a cluster knows its X) and `uplink` there (10.A.0.2). This machine routes 10.A.0.0/16
over it, so the API server, a hub and the tests reach pods, ClusterIPs and NodePorts the way a
client outside a real cluster's nodes does.

Why a namespace of the nodes and not this machine's: kube-proxy's iptables chains have fixed
names (KUBE-SERVICES ...), so two clusters' kube-proxies in one namespace would rewrite each
other's rules (tests run several clusters at once, beside any a developer keeps running); and
every packet of a cluster now passes its own forward hook, where its NetworkPolicies filter it.

A pod's namespace `gdcX-N-K` (its IP's last octets) has `lo` and `eth0`, one end of a veth pair
whose other end (named like the namespace) is in the nodes' namespace; the pod's address is a
/32 with the default route via its node's address, and the nodes' namespace routes the pod's /32
to the veth (routed like Calico: no bridge, so no br_netfilter, a machine-wide switch). Strict
reverse-path filtering drops a pod's packets with another source address than its own; IPv6 is
off (a link-local address would pass the IPv4 policy). Pods' connections leaving the cluster's
network are masqueraded to this machine's address (`gpulab_podnet_X`, the one table here); never
forwarded into another cluster's network.

Everything is named by X, so `down` removes what a killed agent left (`remove_leftovers`). X is
the state dir's own unless another live cluster holds it (its uplink exists with another alias):
then the next free one.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import os
import socket
import subprocess
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from .kube import log

NETNS_DIR = Path("/run/netns")
SYS_NET = Path("/sys/class/net")
OCTETS = range(64, 192)
#: the nodes' namespace's end of the uplink, and the name of the interface there
UPLINK_INSIDE = "uplink"
_CLONE_NEWNET = 0x40000000
#: every cluster network (A = 128..255)
ALL_CLUSTERS = "10.128.0.0/9"


def address_octet(state_dir: Path) -> int:
    """The X a state dir asks for first (64..191): differs between state dirs, so two clusters on
    one machine rarely ask for the same (`NodeNetwork.create` then takes the next free one)."""
    return 64 + zlib.crc32(str(state_dir.resolve()).encode()) % 128


def uplink_name(octet: int) -> str:
    """This machine's end of cluster X's uplink; its alias names the cluster's state dir."""
    return f"gdc{octet}-host"


def nodes_netns(octet: int) -> str:
    return f"gdc{octet}-nodes"


def _owner(octet: int) -> str | None:
    """The state dir whose network holds X = octet (its uplink's alias), or None."""
    try:
        return (SYS_NET / uplink_name(octet) / "ifalias").read_text().strip()
    except OSError:
        return None


def cluster_octet(state_dir: Path) -> int:
    """The X of the cluster of `state_dir` (the one whose uplink names it), else the one it asks
    for first."""
    mine = str(state_dir.resolve())
    for octet in OCTETS:
        if _owner(octet) == mine:
            return octet
    return address_octet(state_dir)


def cluster_network(octet: int) -> ipaddress.IPv4Network:
    """Everything of cluster X: pods, nodes, this machine's address there, Services."""
    return ipaddress.IPv4Network(f"10.{octet + 64}.0.0/16")


def pod_network(octet: int) -> ipaddress.IPv4Network:
    """Pods and nodes (and this machine's address there): kube-proxy's cluster CIDR."""
    return ipaddress.IPv4Network(f"10.{octet + 64}.0.0/17")


def service_cidr(octet: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(f"10.{octet + 64}.128.0/17")


def dns_service_ip(octet: int) -> str:
    """The cluster DNS Service's ClusterIP (a kubelet's --cluster-dns), as kubeadm picks: .10."""
    return str(service_cidr(octet)[10])


def host_address(octet: int) -> str:
    """Where pods reach processes on this machine (the API server, a hub outside the cluster)."""
    return f"10.{octet + 64}.0.1"


def uplink_address(octet: int) -> str:
    return f"10.{octet + 64}.0.2"


def node_pod_cidr(octet: int, index: int) -> str:
    """Node `index`'s (0-based) podCIDR."""
    return f"10.{octet + 64}.{index + 1}.0/24"


def node_address(octet: int, index: int) -> str:
    """Node `index`'s (0-based) InternalIP, in the nodes' namespace."""
    return f"10.{octet + 64}.{index + 1}.1"


def pod_link_name(ip: str) -> str:
    """The pod's network namespace and its veth's other end (at most 15 characters)."""
    a, b, c, d = ip.split(".")
    return f"gdc{int(b) - 64}-{c}-{d}"


def _is_ours(name: str, octet: int) -> bool:
    return name.startswith(f"gdc{octet}-")


def _run(*argv: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


class NodeNetwork:
    """Cluster X's network: the nodes' namespace, the uplink, the routes and the host's table.

    Made by `DevCluster.up` before the control plane (the API server listens on the host's
    address there, and its service CIDR is the cluster's); blocking calls."""

    def __init__(self, state_dir: Path, node_count: int) -> None:
        self.state_dir = state_dir.resolve()
        self.node_count = node_count
        self.octet = address_octet(state_dir)  # until create() has claimed one

    def create(self) -> int:
        """Claim X (the state dir's own, else the next one no other cluster holds), remove what
        a killed cluster of this state dir left, then build the network; returns X."""
        first = address_octet(self.state_dir)
        for step in range(len(OCTETS)):
            octet = OCTETS[(first - OCTETS[0] + step) % len(OCTETS)]
            if _owner(octet) not in (None, str(self.state_dir)):
                continue  # another cluster's, maybe running: never touch it
            remove_leftovers(octet)
            if self._claim(octet):
                self.octet = octet
                break
        else:
            raise RuntimeError(f"every cluster network ({len(OCTETS)} of them) is in use")
        try:
            self._build()
        except BaseException:
            remove_leftovers(self.octet)
            raise
        return self.octet

    @staticmethod
    def _claim(octet: int) -> bool:
        """The nodes' namespace and the uplink for X; False when a cluster starting at the same
        moment made either first."""
        netns = nodes_netns(octet)
        if subprocess.run(["ip", "netns", "add", netns], capture_output=True).returncode != 0:
            return False
        made = subprocess.run(
            ["ip", "link", "add", uplink_name(octet), "type", "veth"]
            + ["peer", "name", UPLINK_INSIDE, "netns", netns],
            capture_output=True,
        )
        if made.returncode != 0:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            return False
        return True

    def _build(self) -> None:
        x, host_end, netns = self.octet, uplink_name(self.octet), nodes_netns(self.octet)
        host, inside = host_address(x), uplink_address(x)
        _run("ip", "link", "set", host_end, "alias", str(self.state_dir))
        # this machine's end: IPv6 off (see the module doc), forwarding on for pods' connections
        # leaving the cluster (masqueraded by the table below), strict reverse-path filtering
        for key, value in (
            (f"ipv6/conf/{host_end}/disable_ipv6", "1"),
            (f"ipv4/conf/{host_end}/forwarding", "1"),
            (f"ipv4/conf/{host_end}/rp_filter", "1"),
        ):
            Path("/proc/sys/net", key).write_text(value)
        _run(
            "ip", "-batch", "-",
            stdin=(
                f"addr add {host}/32 dev {host_end}\n"
                f"link set {host_end} up\n"
                f"route add {inside}/32 dev {host_end} src {host}\n"
                f"route add {cluster_network(x)} via {inside} dev {host_end} src {host}\n"
            ),
        )  # fmt: skip
        # the nodes' namespace routes everything (it is the nodes' network); every interface
        # made there later inherits `default`: no IPv6, strict reverse-path filtering
        _run(
            "ip", "netns", "exec", netns, "sysctl", "-q", "-w",
            "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
            "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=1",
            "net.ipv4.conf.default.rp_filter=1",
        )  # fmt: skip
        batch = "link set lo up\n" + "".join(
            f"addr add {node_address(x, i)}/32 dev lo\n" for i in range(self.node_count)
        )
        batch += (
            f"addr add {inside}/32 dev {UPLINK_INSIDE}\n"
            f"link set {UPLINK_INSIDE} up\n"
            f"route add {host}/32 dev {UPLINK_INSIDE} src {inside}\n"
            f"route add default via {host} dev {UPLINK_INSIDE} src {inside}\n"
            # an address of the cluster that nothing holds goes nowhere (not to this machine,
            # which routes the cluster's network back here)
            f"route add unreachable {cluster_network(x)}\n"
        )
        _run("ip", "-n", netns, "-batch", "-", stdin=batch)
        _run("nft", "-f", "-", stdin=host_table(x))

    def remove(self) -> None:
        remove_leftovers(self.octet)


def host_table_name(octet: int) -> str:
    return f"gpulab_podnet_{octet}"


def host_table(octet: int) -> str:
    """This machine's one table for cluster X: its pods' connections to the outside are
    masqueraded (no other host routes 10.A.0.0/16 back), and nothing from its network is
    forwarded into another cluster's (all of them are in 10.128.0.0/9; the cluster's own
    addresses never come back from its uplink, `unreachable` there)."""
    name, uplink, net = host_table_name(octet), uplink_name(octet), cluster_network(octet)
    return (
        f"table inet {name} {{\n}}\ndelete table inet {name}\n"
        f"table inet {name} {{\n"
        "  chain forward {\n"
        "    type filter hook forward priority 0; policy accept;\n"
        f'    iifname "{uplink}" ip daddr {ALL_CLUSTERS} reject\n'
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f'    ip saddr {net} oifname != "{uplink}" masquerade\n'
        "  }\n"
        "}\n"
    )


class PodNetwork:
    """The agent's side of cluster X's network: the pods' namespaces and veths (async)."""

    def __init__(self, octet: int) -> None:
        self.octet = octet
        self.netns = nodes_netns(octet)

    def check(self) -> None:
        """RuntimeError unless the cluster's network exists (`NodeNetwork.create` made it)."""
        if not (NETNS_DIR / self.netns).exists() or _owner(self.octet) is None:
            raise RuntimeError(
                f"no network for cluster {self.octet} ({NETNS_DIR / self.netns}): "
                "DevCluster.up makes it before it starts the agent"
            )

    async def attach(self, ip: str, node_ip: str) -> Path:
        """The pod's network namespace with `lo` and `eth0` (address `ip`), its default route via
        its node's address; returns the namespace's file (the launcher enters it)."""
        name = pod_link_name(ip)
        await self.detach(ip)  # a namespace of the same address that a crash left
        await _ip("netns", "add", name)
        await _ip(
            "-n", self.netns, "-batch", "-",
            stdin=(
                f"link add {name} type veth peer name eth0 netns {name}\n"
                f"link set {name} up\n"
                f"route add {ip}/32 dev {name} src {node_ip}\n"
            ),
        )  # fmt: skip
        await _ip(
            "-n", name, "-batch", "-",
            stdin=(
                "link set lo up\n"
                "link set eth0 addrgenmode none\n"
                f"addr add {ip}/32 dev eth0\n"
                "link set eth0 up\n"
                f"route add {node_ip} dev eth0 scope link\n"
                f"route add default via {node_ip} dev eth0\n"
            ),
        )  # fmt: skip
        return NETNS_DIR / name

    async def detach(self, ip: str) -> None:
        """The veth pair (its route goes with it) and the namespace; processes still inside keep
        it alive without a network until they exit."""
        name = pod_link_name(ip)
        await _ip("-n", self.netns, "link", "del", name, check=False)
        await _ip("netns", "del", name, check=False)

    def listen(self, host: str, port: int, backlog: int = 128) -> socket.socket:
        """A TCP socket listening on host:port in the nodes' namespace (a node's kubelet API)."""

        def bind_and_listen() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(backlog)
            sock.setblocking(False)
            return sock

        return in_namespace(NETNS_DIR / self.netns, bind_and_listen)


def in_namespace(netns: Path, make: Callable[[], socket.socket]) -> socket.socket:
    """`make()`'s socket, made in network namespace `netns` (a socket stays in the namespace it
    was made in): by a thread of its own that enters the namespace and ends, since a thread that
    entered it would make every socket and child process it made later that namespace's."""
    made: list[socket.socket | BaseException] = []

    def enter_and_make() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY)
            try:
                if _libc().setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {netns}")
            finally:
                os.close(fd)
            made.append(make())
        except BaseException as e:  # handed to the caller's thread
            made.append(e)

    thread = threading.Thread(target=enter_and_make, name=f"netns-{netns.name}")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


async def connect_in(netns: Path | None, port: int, timeout: float = 10.0) -> socket.socket:
    """A connected, non-blocking TCP socket to 127.0.0.1:port in the pod's namespace `netns`
    (in this process's own where the pod has none): what a container runtime's port forward
    connects to, so a server a pod binds to its loopback is reached too."""

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        sock.setblocking(False)
        return sock

    if netns is None:
        return await asyncio.to_thread(connect)
    return await asyncio.to_thread(in_namespace, netns, connect)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


async def _ip(*args: str, stdin: str | None = None, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(
        "ip",
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate(stdin.encode() if stdin is not None else None)
    text = out.decode(errors="replace")
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {text.strip()}")
    return text


def remove_leftovers(octet: int) -> list[str]:
    """Cluster X's uplink, the nodes' namespace (the pods' veths go with it), the pods'
    namespaces and this machine's table (blocking); returns what it removed. Processes still
    inside the nodes' namespace (kube-proxy) keep it alive until they exit: stop them first."""
    removed = []
    links = _run("ip", "-o", "link", "show", check=False)
    for line in links.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if _is_ours(name, octet):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
            removed.append(name)
    for line in _run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if _is_ours(name, octet):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(f"netns {name}")
    table = host_table_name(octet)
    if (
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True).returncode
        == 0
    ):
        removed.append(f"nft table {table}")
    if removed:
        log.info("cluster network: removed %s", ", ".join(removed))
    return removed
