"""The dev cluster's DNS: records from Services, Endpoints and pods, served by a real dnsmasq."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import dns.asyncresolver
import dns.resolver
import pytest

from gpulab.devcluster.agent import podnet
from gpulab.devcluster.agent.clusterdns import (
    ClusterDNS,
    etc_hosts,
    hosts_text,
    pod_hostname,
    pod_records,
    resolv_conf,
    service_records,
)
from tests.harness.kube import Kube, pod_manifest
from tests.harness.wait import wait_for


def _service(name: str, ns: str, cluster_ip: str, **spec: object) -> dict:
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"clusterIP": cluster_ip, **spec}}


def _endpoints(name: str, ns: str, ready: list[dict], not_ready: list[dict] = ()) -> dict:
    subset = {"addresses": ready, "notReadyAddresses": list(not_ready), "ports": [{"port": 80}]}
    return {"metadata": {"name": name, "namespace": ns}, "subsets": [subset]}


SERVICES = [
    _service("hub", "jhub", "10.96.0.20"),
    _service("dask", "alice", "None"),  # headless
    _service("web", "bob", "None", publishNotReadyAddresses=True),
    _service("ext", "bob", "", type="ExternalName", externalName="example.org"),
]
ENDPOINTS = [
    _endpoints("hub", "jhub", [{"ip": "10.244.1.5"}]),
    _endpoints(
        "dask",
        "alice",
        [{"ip": "10.244.1.7", "hostname": "scheduler"}, {"ip": "10.244.2.9"}],
        [{"ip": "10.244.2.10"}],
    ),
    _endpoints("web", "bob", [], [{"ip": "10.244.3.3"}]),
]


def test_records_follow_the_kubernetes_dns_specification() -> None:
    records = service_records(SERVICES, ENDPOINTS)
    assert records == {
        # a ClusterIP Service answers its ClusterIP, never its pods
        "hub.jhub.svc.cluster.local": {"10.96.0.20"},
        # a headless Service answers its ready endpoints only ...
        "dask.alice.svc.cluster.local": {"10.244.1.7", "10.244.2.9"},
        # ... and an endpoint with a hostname has a name of its own
        "scheduler.dask.alice.svc.cluster.local": {"10.244.1.7"},
        # publishNotReadyAddresses: the not-ready ones too
        "web.bob.svc.cluster.local": {"10.244.3.3"},
        # ExternalName (a CNAME) is not served: see the module's docstring
    }
    pods = [
        {"metadata": {"namespace": "alice"}, "status": {"podIP": "10.244.1.7"}},
        {"metadata": {"namespace": "alice"}, "status": {}},  # not started: no record
    ]
    assert pod_records(pods) == {"10-244-1-7.alice.pod.cluster.local": {"10.244.1.7"}}
    text = hosts_text(records)
    assert text.splitlines()[0] == "10.244.1.7 dask.alice.svc.cluster.local"
    assert text == hosts_text(dict(reversed(list(records.items()))))  # stable: no needless reloads


def _free_udp_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _resolver(host: str, port: int) -> dns.asyncresolver.Resolver:
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = port
    resolver.lifetime = 5
    return resolver


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str) -> set[str]:
    answer = await resolver.resolve(name, "A", tcp=False)
    return {r.address for r in answer}


async def _after_reload(
    resolver: dns.asyncresolver.Resolver, name: str, expected: set[str]
) -> set[str]:
    """What the server answers for the name once it shows `expected`, else after 5 s: a reload
    is a signal, so it lands a moment after the update (a cluster's DNS lags its API too)."""
    found: set[str] = set()
    for _ in range(50):
        found = await _addresses_or_none(resolver, name)
        if found == expected:
            break
        await asyncio.sleep(0.1)
    return found


async def _addresses_or_none(resolver: dns.asyncresolver.Resolver, name: str) -> set[str]:
    try:
        return await _addresses(resolver, name)
    except dns.resolver.NXDOMAIN:
        return set()


@pytest.mark.skipif(
    shutil.which("dnsmasq") is None,
    reason="dnsmasq-base is not installed "
    "(gpulab dev-cluster up installs it; this test only runs the server)",
)
async def test_dnsmasq_answers_the_records_and_rereads_them_on_change() -> None:
    host = "127.0.0.1"
    port = _free_udp_port(host)
    # not under pytest's 0700 folders: dnsmasq rereads the file as 'nobody'
    records_dir = Path(tempfile.mkdtemp(prefix="gpulab-dns-test-"))
    records_dir.chmod(0o755)
    server = ClusterDNS(records_dir / "dns", host, port)
    try:
        await server.start(records_dir / "dnsmasq.log")
        server.update(service_records(SERVICES, ENDPOINTS))
        resolver = _resolver(host, port)
        hub = {"10.96.0.20"}
        assert await _after_reload(resolver, "hub.jhub.svc.cluster.local", hub) == hub
        assert await _addresses(resolver, "scheduler.dask.alice.svc.cluster.local") == {
            "10.244.1.7"
        }
        # an unknown name in the zone is NXDOMAIN at once, and nothing outside it is forwarded
        with pytest.raises(dns.resolver.NXDOMAIN):
            await _addresses(resolver, "nope.jhub.svc.cluster.local")
        with pytest.raises((dns.resolver.NoNameservers, dns.resolver.NXDOMAIN)):
            await _addresses(resolver, "pypi.org")
        # a new Service resolves after the update; a deleted one no longer does
        server.update(
            service_records([*SERVICES[1:], _service("new", "jhub", "10.96.0.30")], ENDPOINTS)
        )
        new = {"10.96.0.30"}
        assert await _after_reload(resolver, "new.jhub.svc.cluster.local", new) == new
        assert await _after_reload(resolver, "hub.jhub.svc.cluster.local", set()) == set()
        # the server runs without root's powers: it dropped to 'nobody' after binding
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        assert uid_line.split()[1] != "0"
    finally:
        await server.stop()
        shutil.rmtree(records_dir, ignore_errors=True)
    assert server.proc.returncode is not None


def test_resolv_conf_follows_the_pods_dns_policy() -> None:
    pod = {"metadata": {"namespace": "alice"}, "spec": {}}
    assert resolv_conf(pod, "10.128.0.1") == (
        "nameserver 10.128.0.1\n"
        "search alice.svc.cluster.local svc.cluster.local cluster.local\n"
        "options ndots:5\n"
    )
    assert resolv_conf({**pod, "spec": {"dnsPolicy": "Default"}}, "10.128.0.1") is None
    custom = {
        "dnsPolicy": "None",
        "dnsConfig": {
            "nameservers": ["192.0.2.53"],
            "searches": ["example.org"],
            "options": [{"name": "ndots", "value": "2"}, {"name": "edns0"}],
        },
    }
    assert resolv_conf({**pod, "spec": custom}, "10.128.0.1") == (
        "nameserver 192.0.2.53\nsearch example.org\noptions edns0 ndots:2\n"
    )


# resolves each name given inside the pod and prints {name: [addresses] | "error ..."}
RESOLVE = r"""
import json, socket, sys
out = {"resolv.conf": open("/etc/resolv.conf").read()}
for name in sys.argv[1:]:
    try:
        out[name] = sorted({a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)})
    except OSError as e:
        out[name] = f"error {e}"
print(json.dumps(out), flush=True)
"""


def test_a_pod_resolves_services_and_pods_by_their_cluster_names(kube: Kube) -> None:
    labels = {"app": kube.name("dns")}
    web_name = kube.name("web")
    m = pod_manifest(web_name, [sys.executable, "-m", "http.server", "8000"])
    m["metadata"]["labels"] = labels
    m["spec"]["hostname"], m["spec"]["subdomain"] = "scheduler", labels["app"] + "-h"
    kube.create_pod(m)
    web_ip = kube.wait_ready(web_name)["status"]["podIP"]
    ns = kube.ns
    svc, headless = labels["app"], labels["app"] + "-h"
    for name, cluster_ip in ((svc, None), (headless, "None")):
        spec: dict = {"selector": labels, "ports": [{"port": 80, "targetPort": 8000}]}
        if cluster_ip:
            spec["clusterIP"] = cluster_ip
        kube.api(
            "POST", f"/api/v1/namespaces/{ns}/services", {"metadata": {"name": name}, "spec": spec}
        )
    try:
        cluster_ip = kube.api("GET", f"/api/v1/namespaces/{ns}/services/{svc}")["spec"]["clusterIP"]
        names = [
            svc,  # the short name, through the search list
            f"{svc}.{ns}.svc.cluster.local",
            f"{headless}.{ns}.svc.cluster.local",
            f"scheduler.{headless}.{ns}.svc.cluster.local",
            f"{web_ip.replace('.', '-')}.{ns}.pod.cluster.local",
            f"nope.{ns}.svc.cluster.local",
        ]
        expected = {
            names[0]: [cluster_ip],
            names[1]: [cluster_ip],
            names[2]: [web_ip],
            names[3]: [web_ip],
            names[4]: [web_ip],
        }

        def resolved() -> dict | None:
            probe = kube.name("resolve")
            kube.create_pod(pod_manifest(probe, [sys.executable, "-c", RESOLVE, *names]))
            kube.wait_phase(probe, "Succeeded", "Failed")
            out = json.loads(kube.cluster.logs(probe, ns).strip().splitlines()[-1])
            # the endpoint controller and the DNS watch follow the API a moment behind
            return out if all(out[n] == v for n, v in expected.items()) else None

        out = wait_for("the pod to resolve the cluster's names", resolved, 60, 1)
        # the kube-dns Service's ClusterIP (a kubelet's --cluster-dns), kube-proxy's to route
        octet = podnet.cluster_octet(kube.cluster.state_dir / "agent")
        assert out["resolv.conf"].startswith(f"nameserver {podnet.dns_service_ip(octet)}\n")
        assert (
            f"search {ns}.svc.cluster.local svc.cluster.local cluster.local" in out["resolv.conf"]
        )
        assert str(out[names[5]]).startswith("error")  # unknown in the zone: no address
    finally:
        for name in (svc, headless):
            kube.api("DELETE", f"/api/v1/namespaces/{ns}/services/{name}")


def test_dns_policy_default_keeps_the_hosts_resolv_conf(kube: Kube) -> None:
    name = kube.name("hostdns")
    m = pod_manifest(name, ["cat", "/etc/resolv.conf"])
    m["spec"]["dnsPolicy"] = "Default"
    kube.create_pod(m)
    kube.wait_phase(name, "Succeeded", "Failed")
    assert kube.cluster.logs(name, kube.ns) == Path("/etc/resolv.conf").read_text()


def test_etc_hosts_names_the_pod_as_the_kubelet_does() -> None:
    pod = {
        "metadata": {"name": "web-0", "namespace": "alice"},
        "spec": {
            "hostname": "scheduler",
            "subdomain": "dask",
            "hostAliases": [{"ip": "192.0.2.7", "hostnames": ["db", "db.local"]}],
        },
    }
    lines = etc_hosts(pod, "10.130.1.5").splitlines()
    assert lines[0] == "# Kubernetes-managed hosts file."
    assert "127.0.0.1\tlocalhost" in lines
    assert "10.130.1.5\tscheduler.dask.alice.svc.cluster.local\tscheduler" in lines
    assert lines[-1] == "192.0.2.7\tdb\tdb.local"
    long_name = {"metadata": {"name": "x" * 62 + "-yz", "namespace": "a"}, "spec": {}}
    assert pod_hostname(long_name) == "x" * 62  # a DNS label: 63 at most, no trailing dash


# prints the pod's idea of itself: its hostname, what that resolves to, its /etc/hosts
WHOAMI = r"""
import json, socket
name = socket.gethostname()
print(json.dumps({"hostname": name, "address": socket.gethostbyname(name),
                  "hosts": open("/etc/hosts").read()}), flush=True)
"""


def test_a_pod_has_its_hostname_and_its_address_under_it(kube: Kube) -> None:
    name = kube.name("whoami")
    m = pod_manifest(name, [sys.executable, "-c", WHOAMI])
    kube.create_pod(m)
    pod = kube.wait_phase(name, "Succeeded", "Failed")
    out = json.loads(kube.cluster.logs(name, kube.ns).strip().splitlines()[-1])
    assert out["hostname"] == name  # a UTS namespace of its own: not the machine's name
    assert out["address"] == pod["status"]["podIP"]
    assert out["hosts"].startswith("# Kubernetes-managed hosts file.")
    assert socket.gethostname() != name  # the machine's own is untouched
