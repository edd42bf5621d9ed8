"""Each pod has a network namespace of its own, with an address from its node's podCIDR, routed
through the nodes' network namespace (pods reach each other and the host, the host reaches
them), and the real endpoint controller puts pod IPs into Services' Endpoints. Deleted pods, and
a killed agent's pods after `down`, leave no namespace or veth behind."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gpulab.devcluster import DevCluster, NodeSpec, procs
from gpulab.devcluster.agent import clusterdns, podnet
from tests.harness.kube import CONNECT_SCRIPT, Kube, host_http_server, pod_manifest
from tests.harness.wait import wait_for

# 0.0.0.0: the pod's own namespace (the agent no longer rewrites it to a pod address)
WEB = [sys.executable, "-m", "http.server", "8000", "--bind", "0.0.0.0"]


def _web(kube: Kube, labels: dict[str, str] | None = None) -> dict[str, object]:
    name = kube.name("web")
    m = pod_manifest(name, WEB, readinessProbe={"tcpSocket": {"port": 8000}, "periodSeconds": 1})
    m["metadata"]["labels"] = labels or {"app": name}
    m["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": 8000}]
    kube.create_pod(m)
    return kube.wait_ready(name)


def _run(kube: Kube, command: list[str]) -> str:
    name = kube.name("probe")
    kube.create_pod(pod_manifest(name, command))
    pod = kube.wait_phase(name, "Succeeded", "Failed")
    out = kube.cluster.logs(name, kube.ns)
    assert pod["status"]["phase"] == "Succeeded", out
    return out


def _connect_from_pod(kube: Kube, *targets: str) -> dict[str, str]:
    out = _run(kube, [sys.executable, "-c", CONNECT_SCRIPT, *targets])
    return dict(json.loads(out.strip().splitlines()[-1]))


def _our_links_and_namespaces(octet: int) -> set[str]:
    """Cluster X's links here and in its nodes' namespace, and its network namespaces."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    inside = subprocess.run(
        ["ip", "-n", podnet.nodes_netns(octet), "-o", "link", "show"],
        capture_output=True,
        text=True,
    ).stdout  # "" once the namespace is gone
    names = {line.split(":", 2)[1].strip().split("@")[0] for line in (links + inside).splitlines()}
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names |= {f"netns {line.split()[0]}" for line in netns.splitlines() if line.split()}
    return {n for n in names if n.removeprefix("netns ").startswith(f"gdc{octet}-")}


def test_a_pod_has_its_own_network_namespace_and_an_address_of_its_nodes_pod_cidr(
    kube: Kube,
) -> None:
    name = kube.name("ipaddr")
    kube.create_pod(pod_manifest(name, ["/usr/sbin/ip", "-o", "addr"]))
    pod = kube.wait_phase(name, "Succeeded", "Failed")
    out = kube.cluster.logs(name, kube.ns)
    ip = pod["status"]["podIP"]
    addresses = {(line.split()[1], line.split()[3]) for line in out.strip().splitlines()}
    # no IPv6 address on eth0: a link-local one would reach the host's IPv6 sockets, which the
    # NetworkPolicy (IPv4) does not cover
    assert addresses == {("lo", "127.0.0.1/8"), ("lo", "::1/128"), ("eth0", f"{ip}/32")}, out
    node = kube.node(pod["spec"]["nodeName"])
    cidr = ipaddress.ip_network(node["spec"]["podCIDR"])
    assert node["spec"]["podCIDRs"] == [str(cidr)]
    assert ipaddress.ip_address(ip) in cidr
    octet = podnet.cluster_octet(kube.cluster.state_dir / "agent")
    assert not cidr.overlaps(podnet.service_cidr(octet))
    (internal,) = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    assert pod["status"]["hostIP"] == internal
    assert not ipaddress.ip_address(internal).is_loopback
    assert not ipaddress.ip_address(ip).is_loopback


def test_pods_reach_each_other_and_the_host_and_the_host_reaches_them(kube: Kube) -> None:
    web = _web(kube)
    target = f"{web['status']['podIP']}:8000"  # type: ignore[index]
    assert subprocess.run(["curl", "-sf", "-o", "/dev/null", f"http://{target}/"]).returncode == 0
    host = kube.cluster.host_address
    with host_http_server(host) as port, host_http_server("127.0.0.1") as loopback_port:
        seen = _connect_from_pod(kube, target, f"{host}:{port}", f"127.0.0.1:{loopback_port}")
    # the host's loopback is not the pod's: a host service on 127.0.0.1 is out of its reach
    assert seen == {
        target: "open",
        f"{host}:{port}": "open",
        f"127.0.0.1:{loopback_port}": "refused",
    }


def test_a_deleted_pod_leaves_no_namespace_or_veth(kube: Kube) -> None:
    web = _web(kube)
    ip = str(web["status"]["podIP"])  # type: ignore[index]
    link = podnet.pod_link_name(ip)
    octet = int(link.removeprefix("gdc").split("-")[0])
    assert {link, f"netns {link}"} <= _our_links_and_namespaces(octet)
    name = str(web["metadata"]["name"])  # type: ignore[index]
    kube.delete_pod(name, grace=0)
    kube.wait_gone(name)
    wait_for(
        "the pod's namespace and veth to go",
        lambda: not ({link, f"netns {link}"} & _our_links_and_namespaces(octet)),
        30,
    )


def test_the_endpoint_controller_puts_a_ready_pods_ip_into_its_services_endpoints(
    kube: Kube,
) -> None:
    labels = {"app": kube.name("svc")}
    web = _web(kube, labels)
    name = labels["app"]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    kube.api("POST", f"/api/v1/namespaces/{kube.ns}/services", service)
    try:

        def addresses() -> list[tuple[str, int]] | None:
            ep = kube.api("GET", f"/api/v1/namespaces/{kube.ns}/endpoints/{name}")
            found = [
                (a["ip"], p["port"])
                for s in ep.get("subsets") or []
                for a in s.get("addresses") or []
                for p in s.get("ports") or []
            ]
            return found or None

        found = wait_for("the Service's endpoints", addresses, 30)
        assert found == [(web["status"]["podIP"], 8000)]  # type: ignore[index]
    finally:
        kube.api("DELETE", f"/api/v1/namespaces/{kube.ns}/services/{name}")


def test_down_removes_the_network_a_killed_agent_left(make_dev_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: DevCluster = make_dev_cluster([NodeSpec("net-0", gpus=0)], name="podnet")
    kube = Kube(cluster)
    _web(kube)
    octet = podnet.cluster_octet(cluster.state_dir / "agent")
    assert _our_links_and_namespaces(octet)
    state = json.loads((cluster.state_dir / "cluster.json").read_text())
    os.kill(state["procs"]["agent"]["pid"], signal.SIGKILL)  # no cleanup of its own
    assert _our_links_and_namespaces(octet)
    dns = f"{clusterdns.records_dir(octet)}/"
    assert procs.stray_processes(dns, ("dnsmasq",))  # the cluster's DNS outlives its agent
    cluster.down()
    assert _our_links_and_namespaces(octet) == set()
    assert not procs.stray_processes(dns, ("dnsmasq",))
    assert not clusterdns.records_dir(octet).exists()
    nft = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert podnet.host_table_name(octet) not in nft
    assert not (podnet.NETNS_DIR / podnet.nodes_netns(octet)).exists()


def test_a_cluster_never_takes_the_network_of_another(tmp_path: Path) -> None:
    """Two state dirs may ask for the same X: the second takes the next free one and leaves the
    other cluster's uplink (and so its pods' network) alone."""
    state = tmp_path / "agent"
    first = podnet.address_octet(state)
    foreign = podnet.uplink_name(first)
    subprocess.run(["ip", "link", "add", foreign, "type", "dummy"], check=False)
    if not (podnet.SYS_NET / foreign).exists():  # no dummy module: a bridge holds a name too
        subprocess.run(["ip", "link", "add", foreign, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "link", "set", foreign, "alias", "/another/cluster"], check=True)
        network = podnet.NodeNetwork(state, node_count=1)
        octet = network.create()
        try:
            assert octet != first
            assert podnet.cluster_octet(state) == octet
            assert (podnet.SYS_NET / foreign).exists()
            assert (podnet.NETNS_DIR / podnet.nodes_netns(octet)).exists()
            assert not (podnet.NETNS_DIR / podnet.nodes_netns(first)).exists()
        finally:
            network.remove()
        assert not (podnet.SYS_NET / podnet.uplink_name(octet)).exists()
        assert not (podnet.NETNS_DIR / podnet.nodes_netns(octet)).exists()
    finally:
        subprocess.run(["ip", "link", "del", foreign], check=False)
