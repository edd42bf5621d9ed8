"""The pod network: a network namespace per pod, routed to the host over a veth pair (like Calico).

Address plan of one agent (X = `address_octet(state_dir)`, 64..191, so A = X + 64 is 128..255:
never 10.96.0.0/16, the service CIDR, and another state dir's cluster has another A):

    10.A.0.0/16        the cluster's pod network
    10.A.0.1           the host as pods see it (where a hub outside the cluster listens)
    10.A.N.0/24        node N's podCIDR (N = 1, 2, ... in the order of the nodes)
    10.A.N.1           node N's InternalIP
    10.A.N.2-254       node N's pods

The host and node addresses sit on one bridge per agent, `gdcX-host`, that has no ports: it
only holds them (a dummy link would do, but not every kernel has the module). A pod's
namespace `gdcX-N-K` (its IP's last octets) has `lo` and `eth0`, one end of a veth pair whose
host end is named like the namespace; the pod's address is a /32 with the default route via its
node's address, and the host routes the pod's /32 to the veth. So every packet between pods,
or between a pod and the host, is routed by the host (no bridging): NetworkPolicy can filter it
by address in the forward, input and output hooks (`netpolicy`), without br_netfilter.
Forwarding is switched on for pod veths only (the machine's other interfaces keep their
setting), reverse-path filtering on them drops a pod's packets with another source address
than its own, and IPv6 is off on them (a link-local address would reach the host's IPv6
sockets past the IPv4 policy).

Everything is named by X, so `down` removes what a killed agent left (`remove_leftovers`). X is
the state dir's own unless another live cluster holds it (its bridge exists with another owner):
then the next free one. The bridge's alias names its state dir (`cluster_octet` finds it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import subprocess
import zlib
from pathlib import Path

from .kube import log

NETNS_DIR = Path("/run/netns")
SYS_NET = Path("/sys/class/net")
OCTETS = range(64, 192)


def address_octet(state_dir: Path) -> int:
    """The X a state dir asks for first (64..191): differs between state dirs, so two clusters on
    one machine rarely ask for the same (`PodNetwork.start` then takes the next free one)."""
    return 64 + zlib.crc32(str(state_dir.resolve()).encode()) % 128


def _owner(octet: int) -> str | None:
    """The state dir whose pod network holds X = octet (its bridge's alias), or None."""
    try:
        return (SYS_NET / bridge_name(octet) / "ifalias").read_text().strip()
    except OSError:
        return None


def cluster_octet(state_dir: Path) -> int:
    """The X of the agent of `state_dir` (the one whose bridge names it), else the one it asks
    for first."""
    mine = str(state_dir.resolve())
    for octet in OCTETS:
        if _owner(octet) == mine:
            return octet
    return address_octet(state_dir)


def pod_network(octet: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(f"10.{octet + 64}.0.0/16")


def host_address(octet: int) -> str:
    """Where pods reach processes on the host (the hub, when it runs outside the cluster)."""
    return f"10.{octet + 64}.0.1"


def node_pod_cidr(octet: int, index: int) -> str:
    """Node `index`'s (0-based) podCIDR."""
    return f"10.{octet + 64}.{index + 1}.0/24"


def node_address(octet: int, index: int) -> str:
    """Node `index`'s (0-based) InternalIP: an address of the host, routable from its pods."""
    return f"10.{octet + 64}.{index + 1}.1"


def bridge_name(octet: int) -> str:
    return f"gdc{octet}-host"


def pod_link_name(ip: str) -> str:
    """The pod's network namespace and its veth's host end (at most 15 characters)."""
    a, b, c, d = ip.split(".")
    return f"gdc{int(b) - 64}-{c}-{d}"


def link_pattern(octet: int) -> str:
    """An nft interface name pattern matching the bridge and every pod veth of agent `octet`."""
    return f"gdc{octet}-*"


def _is_ours(name: str, octet: int) -> bool:
    return name.startswith(f"gdc{octet}-")


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


def _sysctl(path: str, value: str) -> None:
    Path("/proc/sys/net", path).write_text(value)


class PodNetwork:
    """One agent's pod network: the host bridge with the node addresses, and the pods' veths."""

    def __init__(self, state_dir: Path, node_count: int) -> None:
        self.state_dir = state_dir.resolve()
        self.node_count = node_count
        self.octet = address_octet(state_dir)  # until start() has claimed one
        self.bridge = bridge_name(self.octet)

    async def start(self) -> int:
        """Claim X (the state dir's own, else the next one no other cluster holds), remove what
        a killed agent of this state dir left, then the bridge with the host and node addresses;
        returns X."""
        first = address_octet(self.state_dir)
        for step in range(len(OCTETS)):
            octet = OCTETS[(first - OCTETS[0] + step) % len(OCTETS)]
            owner = await asyncio.to_thread(_owner, octet)
            if owner not in (None, str(self.state_dir)):
                continue  # another cluster's, maybe running: never touch it
            await asyncio.to_thread(remove_leftovers, octet)
            self.octet, self.bridge = octet, bridge_name(octet)
            out = await _ip("link", "add", self.bridge, "type", "bridge", check=False)
            if out.strip():  # a cluster starting at the same moment took it first
                continue
            break
        else:
            raise RuntimeError(f"every pod network ({len(OCTETS)} of them) is in use")
        await _ip("link", "set", self.bridge, "alias", str(self.state_dir))
        await asyncio.to_thread(_sysctl, f"ipv6/conf/{self.bridge}/disable_ipv6", "1")
        addresses = [host_address(self.octet)] + [
            node_address(self.octet, i) for i in range(self.node_count)
        ]
        batch = "".join(f"addr add {a}/32 dev {self.bridge}\n" for a in addresses)
        await _ip("-batch", "-", stdin=batch + f"link set {self.bridge} up\n")
        return self.octet

    async def stop(self) -> None:
        await asyncio.to_thread(remove_leftovers, self.octet)

    async def attach(self, ip: str, node_ip: str) -> Path:
        """The pod's network namespace with `lo` and `eth0` (address `ip`), its default route via
        its node's address; returns the namespace's file (the launcher enters it). Host
        processes reach the pod from the host address (one source for every node's pods: what
        a NetworkPolicy's ipBlock for a hub outside the cluster names)."""
        name = pod_link_name(ip)
        await self.detach(ip)  # a namespace of the same address that a crash left
        await _ip("netns", "add", name)
        await _ip("link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", name)

        def host_end() -> None:
            # IPv6 off: the pod must not reach the host's IPv6 sockets past the IPv4 policy;
            # forwarding on: pod-to-pod traffic is routed here; strict reverse-path filtering:
            # the pod cannot send with another pod's (or the host's) address
            _sysctl(f"ipv6/conf/{name}/disable_ipv6", "1")
            _sysctl(f"ipv4/conf/{name}/forwarding", "1")
            _sysctl(f"ipv4/conf/{name}/rp_filter", "1")

        await asyncio.to_thread(host_end)
        await _ip(
            "-batch",
            "-",
            stdin=(
                f"link set {name} up\nroute add {ip}/32 dev {name} src {host_address(self.octet)}\n"
            ),
        )
        await _ip(
            "-n",
            name,
            "-batch",
            "-",
            stdin=(
                "link set lo up\n"
                "link set eth0 addrgenmode none\n"
                f"addr add {ip}/32 dev eth0\n"
                "link set eth0 up\n"
                f"route add {node_ip} dev eth0 scope link\n"
                f"route add default via {node_ip} dev eth0\n"
            ),
        )
        return NETNS_DIR / name

    async def detach(self, ip: str) -> None:
        """The veth pair (its route goes with it) and the namespace; processes still inside keep
        it alive without a network until they exit."""
        name = pod_link_name(ip)
        await _ip("link", "del", name, check=False)
        await _ip("netns", "del", name, check=False)


def remove_leftovers(octet: int) -> list[str]:
    """Every veth, namespace and the bridge named for agent `octet` (blocking); returns them."""
    removed = []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if _is_ours(name, octet):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
            removed.append(name)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in netns.splitlines():
        name = line.split()[0] if line.split() else ""
        if _is_ours(name, octet):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(f"netns {name}")
    if removed:
        log.info("pod network: removed %s", ", ".join(removed))
    return removed
