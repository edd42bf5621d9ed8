"""Cluster DNS for the dev cluster: Debian's dnsmasq answering from records kept from the API.

What a real cluster's DNS (CoreDNS with its kubernetes plugin) answers, per the Kubernetes DNS
specification, for the zone (``cluster.local``):

- ``<service>.<namespace>.svc.<zone>``: the Service's ClusterIP; for a headless Service (no
  ClusterIP) the addresses of its ready endpoints (and the not-ready ones when the Service
  publishes them);
- ``<hostname>.<service>.<namespace>.svc.<zone>``: an endpoint with a hostname (a pod with
  ``spec.hostname`` and a ``spec.subdomain`` naming a headless Service, a StatefulSet's pods);
- ``<a-b-c-d>.<namespace>.pod.<zone>``: a pod IP spelled with dashes.

dnsmasq is the server, not a hosts file inside pods: the records are written to a hosts file of
its own (``--addn-hosts``, rewritten whole and swapped in with one rename) and dnsmasq rereads it
on SIGHUP. It answers only its zone (``--local``, nothing forwarded: the cluster has no upstream
it may reach), from a listen address of the agent's choosing. Not answered (dnsmasq cannot reload
them): SRV records and ExternalName CNAMEs.

Why no tenant learns more than in a real cluster: cluster DNS is readable by every pod there too;
the records are names and addresses of Services and pods, never their contents or secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .kube import log, watch_forever

ZONE = "cluster.local"
#: the kubelet's default (resolvConf options): names with fewer dots try the search list first
NDOTS = 5


def records_dir(octet: int) -> Path:
    """Where a cluster's records live: outside the agent's 0700 state folder, since dnsmasq reads
    them as 'nobody'; named for the cluster's pod-network octet, so `down` finds a killed
    agent's dnsmasq by it."""
    return Path(f"/run/gpulab-dns-{octet}")


def resolv_conf(pod: Mapping[str, Any], nameserver: str, zone: str = ZONE) -> str | None:
    """The pod's /etc/resolv.conf as the kubelet writes it; None: the host's (dnsPolicy Default).

    ClusterFirst (the default; ClusterFirstWithHostNet alike, pods have no host network here):
    the cluster's DNS, searching the pod's namespace, then svc, then the zone, ndots:5. None:
    only `dnsConfig`. `dnsConfig` adds nameservers and searches and sets options, as documented.
    """
    spec = pod.get("spec") or {}
    policy = spec.get("dnsPolicy") or "ClusterFirst"
    if policy == "Default" and not spec.get("dnsConfig"):
        return None
    namespace = pod["metadata"]["namespace"]
    nameservers: list[str] = []
    searches: list[str] = []
    options: dict[str, str | None] = {}
    if policy in ("ClusterFirst", "ClusterFirstWithHostNet"):
        nameservers = [nameserver]
        searches = [f"{namespace}.svc.{zone}", f"svc.{zone}", zone]
        options = {"ndots": str(NDOTS)}
    config = spec.get("dnsConfig") or {}
    nameservers += [n for n in config.get("nameservers") or [] if n not in nameservers]
    searches += [d for d in config.get("searches") or [] if d not in searches]
    for option in config.get("options") or []:
        options[option["name"]] = option.get("value")
    lines = [f"nameserver {n}" for n in nameservers[:3]]  # the resolver reads three at most
    if searches:
        lines.append("search " + " ".join(searches))
    if options:
        lines.append(
            "options "
            + " ".join(k if v is None else f"{k}:{v}" for k, v in sorted(options.items()))
        )
    return "".join(line + "\n" for line in lines)


def _ready_addresses(subset: Mapping[str, Any], publish_not_ready: bool) -> list[Mapping[str, Any]]:
    addresses = list(subset.get("addresses") or [])
    if publish_not_ready:
        addresses += list(subset.get("notReadyAddresses") or [])
    return addresses


def service_records(
    services: Iterable[Mapping[str, Any]],
    endpoints: Iterable[Mapping[str, Any]],
    zone: str = ZONE,
) -> dict[str, set[str]]:
    """Name -> addresses for Services (pure: objects as the API returns them)."""
    by_key = {
        (e["metadata"]["namespace"], e["metadata"]["name"]): e.get("subsets") or []
        for e in endpoints
    }
    records: dict[str, set[str]] = {}
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        if spec.get("type") == "ExternalName":
            continue  # a CNAME: dnsmasq cannot reload those (see the module's docstring)
        name = f"{meta['name']}.{meta['namespace']}.svc.{zone}"
        cluster_ip = spec.get("clusterIP") or ""
        headless = cluster_ip in ("", "None")
        publish = bool(spec.get("publishNotReadyAddresses"))
        if not headless:
            records.setdefault(name, set()).add(cluster_ip)
        for subset in by_key.get((meta["namespace"], meta["name"]), []):
            for address in _ready_addresses(subset, publish):
                ip = address.get("ip")
                if not ip:
                    continue
                if headless:
                    records.setdefault(name, set()).add(ip)
                if address.get("hostname"):
                    records.setdefault(f"{address['hostname']}.{name}", set()).add(ip)
    return records


def pod_records(pods: Iterable[Mapping[str, Any]], zone: str = ZONE) -> dict[str, set[str]]:
    """``a-b-c-d.<namespace>.pod.<zone>`` for every pod with an IPv4 pod IP."""
    records: dict[str, set[str]] = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP") or ""
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(ip).version == 4:
                name = f"{ip.replace('.', '-')}.{pod['metadata']['namespace']}.pod.{zone}"
                records.setdefault(name, set()).add(ip)
    return records


def pod_hostname(pod: Mapping[str, Any]) -> str:
    """The pod's hostname: `spec.hostname`, else its name cut to a DNS label (63 characters)."""
    spec = pod.get("spec") or {}
    return str(spec.get("hostname") or pod["metadata"]["name"][:63].rstrip("-."))


def etc_hosts(pod: Mapping[str, Any], ip: str, zone: str = ZONE) -> str:
    """The pod's /etc/hosts as the kubelet manages it: localhost, the pod's address under its
    hostname (and its FQDN when `spec.subdomain` names a headless Service), `hostAliases`."""
    spec = pod.get("spec") or {}
    hostname = pod_hostname(pod)
    names = [hostname]
    if spec.get("subdomain"):
        names.insert(0, f"{hostname}.{spec['subdomain']}.{pod['metadata']['namespace']}.svc.{zone}")
    lines = [
        "# Kubernetes-managed hosts file.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
        f"{ip}\t" + "\t".join(names),
    ]
    aliases = spec.get("hostAliases") or []
    if aliases:
        lines.append("")
        lines.append("# Entries added by HostAliases.")
        lines += [f"{a['ip']}\t" + "\t".join(a.get("hostnames") or []) for a in aliases]
    return "".join(line + "\n" for line in lines)


def hosts_text(records: Mapping[str, set[str]]) -> str:
    """A hosts file: one line per address and name, sorted so an unchanged set reads the same."""
    lines = [f"{ip} {name}" for name in sorted(records) for ip in sorted(records[name])]
    return "".join(line + "\n" for line in lines)


def dnsmasq_command(
    dnsmasq: str, hosts_file: Path, listen: str, port: int, zone: str = ZONE
) -> list[str]:
    return [
        dnsmasq,
        "--keep-in-foreground",
        "--log-facility=-",  # stderr: the agent's log file for it
        "--pid-file=",  # none: the agent holds the process
        "--conf-file=/dev/null",  # not the machine's /etc/dnsmasq.conf
        "--no-resolv",  # nothing is forwarded: names outside the zone get no answer
        "--no-hosts",  # not the machine's /etc/hosts
        f"--addn-hosts={hosts_file}",
        f"--local=/{zone}/",  # the zone is ours alone: unknown names in it are NXDOMAIN
        f"--listen-address={listen}",
        "--bind-interfaces",  # that address only: another cluster's dnsmasq may use the port
        f"--port={port}",
        "--no-negcache",  # a Service created a moment ago resolves right after the reload
        # dnsmasq drops root for 'nobody' once its socket is bound (the default), so what
        # parses the pods' queries holds no privilege; the reread file must be readable by it
    ]


class ClusterDNS:
    """One dnsmasq for the cluster, reloaded whenever the records change.

    `records_dir` must be readable by everyone (dnsmasq rereads the file as 'nobody'): keep it
    out of the agent's 0700 state folder. It holds nothing a pod could not ask the server for.
    """

    def __init__(self, records_dir: Path, listen: str, port: int = 53, zone: str = ZONE) -> None:
        self.records_dir = records_dir
        self.listen = listen
        self.port = port
        self.zone = zone
        self.hosts_file = records_dir / "hosts"
        self.proc: asyncio.subprocess.Process | None = None
        self._written: str | None = None

    async def start(self, log_path: Path, dnsmasq: str = "dnsmasq") -> None:
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.records_dir.chmod(0o755)
        for folder in self.records_dir.resolve().parents:
            if not folder.stat().st_mode & 0o001:
                raise RuntimeError(
                    f"cluster DNS records in {self.records_dir}: dnsmasq reads them as 'nobody', "
                    f"who may not pass {folder} (mode {folder.stat().st_mode & 0o777:o})"
                )
        self._write("")
        log_file = await asyncio.to_thread(open, log_path, "ab")  # dnsmasq keeps its own copy
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *dnsmasq_command(dnsmasq, self.hosts_file, self.listen, self.port, self.zone),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
            )
        finally:
            log_file.close()
        # a SIGHUP before dnsmasq has its handlers would end it: wait for its "started" line
        for _ in range(100):
            if self.proc.returncode is not None:
                raise RuntimeError(f"dnsmasq exited at start; see {log_path}")
            if b"started, version" in await asyncio.to_thread(log_path.read_bytes):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"dnsmasq did not start within 5 s; see {log_path}")

    def _write(self, text: str) -> bool:
        if text == self._written:
            return False
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        os.replace(tmp, self.hosts_file)
        self._written = text
        return True

    def update(self, records: Mapping[str, set[str]]) -> None:
        """Write the records and make dnsmasq reread them (no reload when nothing changed)."""
        if self._write(hosts_text(records)) and self.proc and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGHUP)

    async def watch(self, core: Any) -> None:
        """Keep the records current from the API (Services, Endpoints, pods; all namespaces)."""
        objects: dict[str, dict[tuple[str, str], Mapping[str, Any]]] = {
            "services": {},
            "endpoints": {},
            "pods": {},
        }

        def handler(kind: str) -> Any:
            async def handle(event: str, obj: dict[str, Any]) -> None:
                key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                if event == "DELETED":
                    objects[kind].pop(key, None)
                else:
                    objects[kind][key] = obj
                records = service_records(
                    objects["services"].values(), objects["endpoints"].values(), self.zone
                )
                records.update(pod_records(objects["pods"].values(), self.zone))
                self.update(records)

            return handle

        def resync(kind: str) -> Any:
            async def forget(items: list[dict[str, Any]]) -> None:
                objects[kind].clear()  # a relist replaces what was known

            return forget

        await asyncio.gather(
            watch_forever(
                "services",
                core.list_service_for_all_namespaces,
                handler("services"),
                resync=resync("services"),
            ),
            watch_forever(
                "endpoints",
                core.list_endpoints_for_all_namespaces,
                handler("endpoints"),
                resync=resync("endpoints"),
            ),
            watch_forever(
                "pods",
                core.list_pod_for_all_namespaces,
                handler("pods"),
                resync=resync("pods"),
            ),
        )

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except asyncio.TimeoutError:
            log.warning("dnsmasq did not stop on SIGTERM; killing it")
            self.proc.kill()
            await self.proc.wait()
