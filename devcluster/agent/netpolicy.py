"""NetworkPolicy enforcement for the cluster's pods: one nftables table, rebuilt from the policies.

Each pod has a network namespace of its own, routed through the nodes' network namespace
(`podnet`): every packet between two pods, between a pod and this machine (the hub, the API
server) or the outside, passes the nodes' namespace's IP stack, where this table lives, so a pod
is known by its address, as with Calico or kube-router:

- `forward` (pod to pod, pod to this machine or outside, this machine to a pod): a connection to
  one of the cluster's pods goes to the receiver's chain, which admits a sender pod only where
  the sender's egress rules *and* the receiver's ingress rules allow it, ports included, and an
  address that is no pod (this machine's: a hub, the proxy, the agent's probes) where an ipBlock
  of the receiver's ingress rules holds it; a connection from a pod to an address that is no pod
  must pass the sender's egress rules (ipBlock peers). Service traffic is filtered after
  kube-proxy's DNAT (this hook runs after prerouting), so by the pod it reaches, as in a real
  cluster;
- `input` (pod to the nodes' own addresses: the kubelet API, NodePorts' holders): the sender's
  egress rules;
- `output` (the nodes' namespace's processes to a pod): the receiver's ingress rules.

Traffic within one pod never leaves its namespace (its "localhost"). A pod cannot send with
another address than its own (strict reverse-path filtering, `podnet`). Refused connections get
a TCP reset (ICMP admin-prohibited for other protocols) rather than a silent drop, so clients fail
at once. Established and related traffic always passes. What is enforced: podSelector,
namespaceSelector (matchLabels, matchExpressions), ipBlock with except, ports by number or by the
receiving container's port name, protocols TCP/UDP/SCTP, policyTypes. Not: endPort.
"""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .kube import log

#: the table's name in the nodes' network namespace (one cluster per namespace)
TABLE = "gpulab_netpol"
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


def _chain_id(pod: PodNet) -> str:
    return pod.ip.replace(".", "_")


def compile_ruleset(
    table: str,
    pods: list[PodNet],
    policies: list[Mapping[str, Any]],
    namespaces: Mapping[str, Mapping[str, str]],
) -> str:
    """The nft script that replaces table `inet <table>` (atomically: nft -f is one transaction)."""
    refuse = ["meta l4proto tcp reject with tcp reset", "reject"]
    established = "ct state established,related accept"
    forward, inp, out = [established], [established], [established]
    chains: dict[str, list[str]] = {}
    pod_ips = [p.ip for p in pods]
    for pod in pods:
        egress = _selecting(pod, policies, "Egress")
        if egress:
            rules = [
                (r, r.get("to")) for p in egress for r in (p.get("spec") or {}).get("egress") or []
            ]
            # to the outside and to host processes (the hub, the API server): ipBlock peers
            name = f"egress_{_chain_id(pod)}"
            chains[name] = [*_address_rules(rules, "daddr", ""), *refuse]
            inp.append(f"ip saddr {pod.ip} jump {name}")
    for receiver in pods:
        name = f"to_{_chain_id(receiver)}"
        # a pod reaching itself through a Service (kube-proxy's hairpin: the packet leaves the
        # pod and comes back DNATed to it) stays within the pod, as its localhost does
        lines = [f"ip saddr {receiver.ip} accept"]
        for sender in pods:
            if sender is receiver:
                continue
            allowed = pod_to_pod(sender, receiver, policies, namespaces)
            if allowed is not ALL and not allowed:
                continue
            for pm in _port_match(allowed):
                lines.append(" ".join(x for x in (f"ip saddr {sender.ip}", pm, "accept") if x))
        if pod_ips:  # any other pod of this agent: refused unless admitted above
            lines.append(f"ip saddr {{ {', '.join(pod_ips)} }} jump refuse")
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
            lines += _address_rules(named, "saddr", "")
            lines += refuse
        else:
            lines.append("accept")
        chains[name] = lines
        forward.append(f"ip daddr {receiver.ip} jump {name}")
        out.append(f"ip daddr {receiver.ip} jump {name}")
    for pod in pods:  # to a destination that is none of the agent's pods
        if f"egress_{_chain_id(pod)}" in chains:
            forward.append(f"ip saddr {pod.ip} jump egress_{_chain_id(pod)}")

    def chain(name: str, body: list[str], hook: str | None = None) -> str:
        head = f"    type filter hook {hook} priority 0; policy accept;\n" if hook else ""
        return f"  chain {name} {{\n{head}" + "".join(f"    {line}\n" for line in body) + "  }\n"

    text = f"table inet {table} {{\n}}\ndelete table inet {table}\ntable inet {table} {{\n"
    text += chain("refuse", refuse)
    text += chain("forward", forward, "forward") + chain("input", inp, "input")
    text += chain("output", out, "output")
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

    def __init__(self, table: str = TABLE, *, netns: str | None = None) -> None:
        """netns: the network namespace the table lives in (None: this process's)."""
        self.table, self.netns = table, netns
        self.pods: dict[str, PodNet] = {}
        self.policies: dict[str, dict[str, Any]] = {}
        self.namespaces: dict[str, dict[str, str]] = {}
        self._lock = asyncio.Lock()

    async def apply(self) -> None:
        """Load the table for the current pods and policies; RuntimeError when nft refuses."""
        async with self._lock:
            script = compile_ruleset(
                self.table,
                sorted(self.pods.values(), key=lambda p: ipaddress.ip_address(p.ip)),
                list(self.policies.values()),
                self.namespaces,
            )
            proc = await asyncio.create_subprocess_exec(
                *(("ip", "netns", "exec", self.netns) if self.netns else ()),
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
        """The table (after a killed agent, the nodes' namespace goes with it at `down`)."""
        await asyncio.to_thread(remove_table, self.table, self.netns)

    # -- pods joining and leaving -------------------------------------------------------------

    async def join(self, pod: dict[str, Any], ip: str) -> None:
        """The table with the pod in it (before its first process starts)."""
        self.pods[pod["metadata"]["uid"]] = self._pod_net(pod, ip)
        await self.apply()

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


def remove_table(table: str, netns: str | None = None) -> None:
    """Delete nft table `inet <table>` if it exists (blocking)."""
    if shutil.which("nft") is not None:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        subprocess.run([*prefix, "nft", "delete", "table", "inet", table], capture_output=True)


def unavailable_reason() -> str | None:
    """Why this machine cannot enforce NetworkPolicies, or None."""
    if shutil.which("nft") is None:
        return "nft is not installed (apt-get install nftables)"
    return None
