"""NetworkPolicy enforcement for the agent's pods: one nftables table, rebuilt from the policies.

Pods share the host's network (each on its own loopback address), so a pod is told apart by
its processes' cgroup, not by its address: every pod's processes run in a cgroup v2 of their
own (`<cgroup2>/gpulab-<X>/<pod uid>`, joined by launcher.py before the exec), and

- at `output`, a new connection from a pod's socket gets the pod's conntrack mark (0: a host
  process such as the hub); a pod's connection to an address outside the machine is checked
  against its egress rules there;
- at `input`, the receiving socket's cgroup names the receiving pod (nft's socket lookup), the
  mark names the sender: a connection within one pod passes (its own "localhost"), else it
  must be allowed by the sender's egress rules *and* the receiver's ingress rules, ports
  included; a pod's connection to a host process needs the sender's egress rules alone.

A sender pod's address, for ipBlock peers, is its pod IP (as it would be on a pod network); a
host sender's is the packet's source address. Refused connections get a TCP reset (ICMP
admin-prohibited for other protocols) rather than a silent drop, so clients fail at once.
Established and related traffic always passes. What is enforced: podSelector,
namespaceSelector (matchLabels, matchExpressions), ipBlock with except, ports by number or by
the receiving container's port name, protocols TCP/UDP/SCTP, policyTypes. Not: endPort.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kube import log

#: low bits of a pod's conntrack mark that number the pods of one agent; the bits above are the
#: agent's own (its address octet), so no two agents on one machine hand out the same mark
MARK_INDEX_BITS = 16

#: a set of (protocol, port) pairs, or None for every port
Ports = frozenset[tuple[str, int]] | None
ALL: Ports = None


@dataclass(frozen=True)
class PodNet:
    """What enforcement needs to know of one running pod."""

    uid: str
    namespace: str
    labels: Mapping[str, str]
    ip: str
    cgroup: str  # relative to /sys/fs/cgroup, as nft resolves it
    mark: int
    named_ports: Mapping[str, tuple[str, int]] = field(default_factory=dict)


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against labels; {} selects all."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def policy_types(policy: Mapping[str, Any]) -> list[str]:
    spec = policy.get("spec") or {}
    if spec.get("policyTypes"):
        return list(spec["policyTypes"])
    return ["Ingress", *(["Egress"] if spec.get("egress") else [])]


def _in_block(ip: str, block: Mapping[str, Any]) -> bool:
    addr = ipaddress.ip_address(ip)
    if addr not in ipaddress.ip_network(block["cidr"], strict=False):
        return False
    return not any(addr in ipaddress.ip_network(e, strict=False) for e in block.get("except") or [])


def _peer_matches_pod(
    peer: Mapping[str, Any],
    policy_ns: str,
    pod: PodNet,
    namespaces: Mapping[str, Mapping[str, str]],
) -> bool:
    if "ipBlock" in peer:
        return _in_block(pod.ip, peer["ipBlock"])
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_sel is None and pod.namespace != policy_ns:
        return False
    if ns_sel is not None and not selects(ns_sel, namespaces.get(pod.namespace, {})):
        return False
    return pod_sel is None or selects(pod_sel, pod.labels)


def _ports(rule: Mapping[str, Any], named: Mapping[str, tuple[str, int]]) -> Ports:
    """The rule's ports; a named port resolves through `named` (the receiving container's
    ports) or matches nothing. A protocol without a port counts as every port."""
    if not rule.get("ports"):
        return ALL
    out: set[tuple[str, int]] = set()
    for p in rule["ports"]:
        proto = (p.get("protocol") or "TCP").lower()
        port = p.get("port")
        if port is None:
            return ALL
        if isinstance(port, str) and not port.isdigit():
            if port in named and named[port][0] == proto:
                out.add((proto, named[port][1]))
            continue
        out.add((proto, int(port)))
    return frozenset(out)


def _union(a: Ports, b: Ports) -> Ports:
    if a is None or b is None:
        return ALL
    return a | b


def _intersect(a: Ports, b: Ports) -> Ports:
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def _selecting(pod: PodNet, policies: Iterable[Mapping[str, Any]], kind: str) -> list[Any]:
    return [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and kind in policy_types(p)
        and selects((p.get("spec") or {}).get("podSelector") or {}, pod.labels)
    ]


def pod_to_pod(
    sender: PodNet,
    receiver: PodNet,
    policies: list[Mapping[str, Any]],
    namespaces: Mapping[str, Mapping[str, str]],
) -> Ports:
    """The ports `sender` may open on `receiver`: ALL, a set (maybe empty) of ports."""
    allowed: Ports = ALL
    egress = _selecting(sender, policies, "Egress")
    if egress:
        allowed = frozenset()
        for p in egress:
            for rule in (p.get("spec") or {}).get("egress") or []:
                peers = rule.get("to")
                ns = p["metadata"]["namespace"]
                if not peers or any(_peer_matches_pod(x, ns, receiver, namespaces) for x in peers):
                    allowed = _union(allowed, _ports(rule, receiver.named_ports))
    ingress = _selecting(receiver, policies, "Ingress")
    if ingress:
        admitted: Ports = frozenset()
        for p in ingress:
            for rule in (p.get("spec") or {}).get("ingress") or []:
                peers = rule.get("from")
                ns = p["metadata"]["namespace"]
                if not peers or any(_peer_matches_pod(x, ns, sender, namespaces) for x in peers):
                    admitted = _union(admitted, _ports(rule, receiver.named_ports))
        allowed = _intersect(allowed, admitted)
    return allowed


def _port_match(ports: Ports) -> list[str]:
    """nft match fragments for a port set (one per protocol; [""] for every port)."""
    if ports is None:
        return [""]
    by_proto: dict[str, list[int]] = {}
    for proto, port in sorted(ports):
        by_proto.setdefault(proto, []).append(port)
    return [
        f"meta l4proto {proto} th dport {{ {', '.join(map(str, nums))} }}"
        for proto, nums in by_proto.items()
    ]


def _block_match(direction: str, block: Mapping[str, Any]) -> str:
    net = ipaddress.ip_network(block["cidr"], strict=False)
    fam = "ip" if net.version == 4 else "ip6"
    text = f"{fam} {direction} {net}"
    excepts = [str(ipaddress.ip_network(e, strict=False)) for e in block.get("except") or []]
    if excepts:
        text += f" {fam} {direction} != {{ {', '.join(excepts)} }}"
    return text


def _address_rules(
    rules: Iterable[tuple[Mapping[str, Any], list[Any] | None]], direction: str, prefix: str
) -> list[str]:
    """accept lines for connections to (or from) addresses of host processes and the outside:
    only ipBlock peers, or a rule without peers, can match those."""
    lines = []
    for rule, peers in rules:
        ports = _ports(rule, {})
        if ports is not ALL and not ports:
            continue
        for pm in _port_match(ports):
            if not peers:
                lines.append(" ".join(x for x in (prefix, pm, "accept") if x))
                continue
            for peer in peers:
                if "ipBlock" in peer:
                    blk = _block_match(direction, peer["ipBlock"])
                    lines.append(" ".join(x for x in (prefix, blk, pm, "accept") if x))
    return lines


def compile_ruleset(
    table: str,
    pods: list[PodNet],
    policies: list[Mapping[str, Any]],
    namespaces: Mapping[str, Mapping[str, str]],
) -> str:
    """The nft script that replaces table `inet <table>` (atomically: nft -f is one transaction)."""
    refuse = ["meta l4proto tcp reject with tcp reset", "reject"]
    out = ["ct state established,related accept"]
    inp = ["ct state established,related accept"]
    chains: dict[str, list[str]] = {}
    for pod in pods:
        out.append(f'socket cgroupv2 level 2 "{pod.cgroup}" ct mark set {pod.mark}')
    for pod in pods:
        egress = _selecting(pod, policies, "Egress")
        if egress:
            rules = [
                (r, r.get("to")) for p in egress for r in (p.get("spec") or {}).get("egress") or []
            ]
            # to the outside (at output: never a pod, every pod address is local here) and to a
            # host process of this machine (at input: the hub, the API server)
            name = f"egress_{pod.mark}"
            chains[name] = [*_address_rules(rules, "daddr", ""), *refuse]
            out.append(f"ct mark {pod.mark} fib daddr type != local jump {name}")
    for receiver in pods:
        name = f"to_{receiver.mark}"
        lines = [f"ct mark {receiver.mark} accept"]  # within the pod
        for sender in pods:
            if sender is receiver:
                continue
            allowed = pod_to_pod(sender, receiver, policies, namespaces)
            if allowed is not ALL and not allowed:
                continue
            for pm in _port_match(allowed):
                lines.append(" ".join(x for x in (f"ct mark {sender.mark}", pm, "accept") if x))
        ingress = _selecting(receiver, policies, "Ingress")
        if ingress:
            rules = [
                (r, r.get("from"))
                for p in ingress
                for r in (p.get("spec") or {}).get("ingress") or []
            ]
            named = [
                (
                    dict(r, ports=[_resolve(pt, receiver) for pt in r.get("ports") or []] or None),
                    peers,
                )
                for r, peers in rules
            ]
            lines += _address_rules(named, "saddr", "ct mark 0")
        else:
            lines.append("ct mark 0 accept")
        chains[name] = [*lines, *refuse]
        inp.append(f'socket cgroupv2 level 2 "{receiver.cgroup}" jump {name}')
    for pod in pods:
        if f"egress_{pod.mark}" in chains:
            inp.append(f"ct mark {pod.mark} jump egress_{pod.mark}")

    def chain(name: str, body: list[str], hook: str | None = None) -> str:
        head = f"    type filter hook {hook} priority 0; policy accept;\n" if hook else ""
        return f"  chain {name} {{\n{head}" + "".join(f"    {line}\n" for line in body) + "  }\n"

    text = f"table inet {table} {{\n}}\ndelete table inet {table}\ntable inet {table} {{\n"
    text += chain("output", out, "output") + chain("input", inp, "input")
    text += "".join(chain(n, b) for n, b in chains.items())
    return text + "}\n"


def _resolve(port: Mapping[str, Any], pod: PodNet) -> dict[str, Any]:
    value = port.get("port")
    if isinstance(value, str) and not value.isdigit() and value in pod.named_ports:
        proto, number = pod.named_ports[value]
        return {"protocol": proto.upper(), "port": number}
    return dict(port)


class Enforcer:
    """The agent's view of pods and policies, and the nft table made from it."""

    def __init__(self, table: str, cgroup_root: str, octet: int) -> None:
        self.table = table
        # Conntrack marks are the machine's, not the table's: a table left by a killed agent
        # (SIGKILL skips remove()) or a second cluster's table sees every connection's mark. Marks
        # from this agent's own range (its address octet in the high bits) keep those tables
        # blind to this agent's pods, which would otherwise be refused or admitted by another
        # cluster's rules for "pod 3".
        self.mark_base = octet << MARK_INDEX_BITS
        self.cgroup_root = cgroup_root  # e.g. "unified/gpulab-170", relative to /sys/fs/cgroup
        self.pods: dict[str, PodNet] = {}
        self.policies: dict[str, dict[str, Any]] = {}
        self.namespaces: dict[str, dict[str, str]] = {}
        self._marks: dict[str, int] = {}
        self._lock = asyncio.Lock()

    def mark_of(self, uid: str) -> int:
        if uid not in self._marks:
            if len(self._marks) + 1 >= 1 << MARK_INDEX_BITS:
                raise RuntimeError("the agent has run out of NetworkPolicy marks; restart it")
            self._marks[uid] = self.mark_base | (len(self._marks) + 1)
        return self._marks[uid]

    async def apply(self) -> None:
        """Load the table for the current pods and policies; RuntimeError when nft refuses."""
        async with self._lock:
            script = compile_ruleset(
                self.table,
                sorted(self.pods.values(), key=lambda p: p.mark),
                list(self.policies.values()),
                self.namespaces,
            )
            proc = await asyncio.create_subprocess_exec(
                "nft",
                "-f",
                "-",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            output, _ = await proc.communicate(script.encode())
            if proc.returncode != 0:
                raise RuntimeError(f"nft refused the NetworkPolicy table: {output.decode()[:2000]}")

    async def remove(self) -> None:
        """The table and the (by now empty) cgroup folder of the agent's pods."""
        with contextlib.suppress(OSError):
            (CGROUP_FS / self.cgroup_root).rmdir()
        proc = await asyncio.create_subprocess_exec(
            "nft",
            "delete",
            "table",
            "inet",
            self.table,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await proc.wait()

    # -- pods joining and leaving -------------------------------------------------------------

    def cgroup_dir(self, uid: str) -> Path:
        return CGROUP_FS / self.cgroup_root / uid

    async def join(self, pod: dict[str, Any], ip: str) -> Path:
        """The pod's cgroup (its processes join it before they exec), and the table with it;
        returns the cgroup's cgroup.procs."""
        meta = pod["metadata"]
        d = self.cgroup_dir(meta["uid"])
        d.mkdir(parents=True, exist_ok=True)
        self.pods[meta["uid"]] = self._pod_net(pod, ip)
        await self.apply()
        return d / "cgroup.procs"

    def _pod_net(self, pod: dict[str, Any], ip: str) -> PodNet:
        meta = pod["metadata"]
        named = {
            p["name"]: ((p.get("protocol") or "TCP").lower(), int(p["containerPort"]))
            for c in (pod.get("spec") or {}).get("containers") or []
            for p in c.get("ports") or []
            if p.get("name")
        }
        return PodNet(
            uid=meta["uid"],
            namespace=meta["namespace"],
            labels=dict(meta.get("labels") or {}),
            ip=ip,
            cgroup=f"{self.cgroup_root}/{meta['uid']}",
            mark=self.mark_of(meta["uid"]),
            named_ports=named,
        )

    async def relabel(self, pod: dict[str, Any]) -> None:
        current = self.pods.get(pod["metadata"]["uid"])
        if current is not None and dict(current.labels) != (pod["metadata"].get("labels") or {}):
            self.pods[current.uid] = self._pod_net(pod, current.ip)
            await self.apply()

    async def leave(self, uid: str) -> None:
        if self.pods.pop(uid, None) is not None:
            await self.apply()
        d = self.cgroup_dir(uid)
        for _ in range(50):  # the pod's last processes may still be on their way out
            try:
                d.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                await asyncio.sleep(0.1)
        log.warning("cgroup %s still busy; left behind", d)

    async def set_policy(self, event: str, policy: dict[str, Any]) -> None:
        key = f"{policy['metadata']['namespace']}/{policy['metadata']['name']}"
        if event == "DELETED":
            self.policies.pop(key, None)
        else:
            self.policies[key] = policy
        await self._apply_logged()

    async def set_namespace(self, event: str, ns: dict[str, Any]) -> None:
        name = ns["metadata"]["name"]
        if event == "DELETED":
            self.namespaces.pop(name, None)
        else:
            self.namespaces[name] = dict(ns["metadata"].get("labels") or {})
        await self._apply_logged()

    async def _apply_logged(self) -> None:
        try:
            await self.apply()
        except RuntimeError as e:
            log.error("%s", e)


CGROUP_FS = Path("/sys/fs/cgroup")


def cgroup2_root() -> str | None:
    """Where cgroup v2 is mounted, relative to /sys/fs/cgroup ("" on a pure v2 system,
    "unified" on a hybrid one); None when it is not mounted there."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup2":
            mount = Path(fields[4])
            if mount == CGROUP_FS or CGROUP_FS in mount.parents:
                rel = str(mount.relative_to(CGROUP_FS))
                return "" if rel == "." else rel
    return None


def unavailable_reason() -> str | None:
    """Why this machine cannot enforce NetworkPolicies, or None."""
    if shutil.which("nft") is None:
        return "nft is not installed (apt-get install nftables)"
    if cgroup2_root() is None:
        return "cgroup v2 is not mounted under /sys/fs/cgroup"
    return None
