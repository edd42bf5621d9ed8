"""The node agent enforces NetworkPolicies: pods selected by a policy accept and open only the
connections its rules allow, ports and the cloud metadata address included."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest

from gpulab.devcluster.agent import netpolicy, podnet
from gpulab.spawner.kube.objects import CLOUD_METADATA_IP, singleuser_network_policy
from tests.harness.kube import CONNECT_SCRIPT, Kube, host_http_server, pod_manifest
from tests.harness.wait import wait_for

NETPOL_API = "/apis/networking.k8s.io/v1/namespaces"

pytestmark = pytest.mark.skipif(
    netpolicy.unavailable_reason() is not None,
    reason=f"the node agent cannot enforce NetworkPolicies here: {netpolicy.unavailable_reason()}",
)


WEB = [sys.executable, "-m", "http.server", "8000", "--bind", "$(POD_IP)"]  # or 0.0.0.0: the same
POD_IP = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _web(kube: Kube, labels: dict[str, str]) -> str:
    """A pod serving HTTP on its pod IP, port 8000; its IP once Ready."""
    name = kube.name("web")
    m = pod_manifest(name, WEB, readinessProbe={"tcpSocket": {"port": 8000}, "periodSeconds": 1})
    m["metadata"]["labels"] = labels
    m["spec"]["containers"][0]["env"].append(POD_IP)
    m["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": 8000}]
    kube.create_pod(m)
    return str(kube.wait_ready(name)["status"]["podIP"])


def _connect_from(kube: Kube, labels: dict[str, str], *targets: str) -> dict[str, str]:
    name = kube.name("client")
    m = pod_manifest(name, [sys.executable, "-c", CONNECT_SCRIPT, *targets])
    m["metadata"]["labels"] = labels
    kube.create_pod(m)
    pod = kube.wait_phase(name, "Succeeded", "Failed")
    out = kube.cluster.logs(name, kube.ns)
    assert pod["status"]["phase"] == "Succeeded", out
    return json.loads(out.strip().splitlines()[-1])


def _from_host(target: str) -> str:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return "open"
    except ConnectionRefusedError:
        return "refused"


@contextlib.contextmanager
def _policy(kube: Kube, body: dict[str, Any]) -> Iterator[None]:
    name = body["metadata"]["name"]
    kube.api("POST", f"{NETPOL_API}/{kube.ns}/networkpolicies", body)
    try:
        yield
    finally:
        with contextlib.suppress(urllib.error.HTTPError):
            kube.api("DELETE", f"{NETPOL_API}/{kube.ns}/networkpolicies/{name}")


def _until(kube: Kube, what: str, check: Any) -> None:
    """The agent applies a new policy within moments of the API accepting it."""
    wait_for(what, check, 30, 0.5)


def test_an_ingress_policy_admits_only_the_selected_pods_on_the_allowed_port(
    kube_ns: Kube,
) -> None:
    kube = kube_ns
    ip = _web(kube, {"app": "web"})
    target = f"{ip}:8000"
    assert _connect_from(kube, {"role": "client"}, target) == {target: "open"}  # no policy yet
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "web-ingress"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "web"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {"role": "allowed"}}}],
                    "ports": [{"port": "http"}],  # the receiving container's named port
                }
            ],
        },
    }
    with _policy(kube, policy):
        _until(kube, "the host to be refused", lambda: _from_host(target) == "refused")
        assert _connect_from(kube, {"role": "client"}, target) == {target: "refused"}
        assert _connect_from(kube, {"role": "allowed"}, target) == {target: "open"}
    _until(kube, "the policy's end to open the server again", lambda: _from_host(target) == "open")


def test_the_servers_policy_lets_only_the_hub_in_and_keeps_the_metadata_address_out(
    kube_ns: Kube,
) -> None:
    kube = kube_ns
    server_labels = {"component": "singleuser-server", "app": "jupyterhub"}
    # a hub outside the cluster: on the host's address on the pod network, the source of the
    # host's connections to pods too
    host = kube.cluster.host_address
    added = subprocess.run(
        ["ip", "addr", "add", f"{CLOUD_METADATA_IP}/32", "dev", "lo"], capture_output=True
    )
    try:
        with (
            host_http_server(host) as hub_port,
            host_http_server(CLOUD_METADATA_IP) as meta_port,
            host_http_server(host) as other_port,
        ):
            policy = singleuser_network_policy(
                "gpulab-singleuser",
                pod_selector=server_labels,
                server_port=8000,
                hub_selector={"component": "hub"},
                hub_ports=[hub_port],
                hub_cidrs=[f"{host}/32"],
            )
            ip = _web(kube, server_labels)
            with _policy(kube, policy):
                target = f"{ip}:8000"
                _until(
                    kube,
                    "another server to be refused",
                    lambda: _connect_from(kube, server_labels, target)[target] == "refused",
                )
                assert _from_host(target) == "open"  # the hub and proxy: the host address
                hub, meta, other = (
                    f"{host}:{hub_port}",
                    f"{CLOUD_METADATA_IP}:{meta_port}",
                    f"{host}:{other_port}",
                )
                assert _from_host(meta) == "open"  # there, for the machine itself
                seen = _connect_from(kube, server_labels, hub, meta, other)
                assert seen == {hub: "open", meta: "refused", other: "refused"}
    finally:
        if added.returncode == 0:
            subprocess.run(["ip", "addr", "del", f"{CLOUD_METADATA_IP}/32", "dev", "lo"])


def test_a_killed_agents_table_leaves_another_clusters_pods_alone(kube_ns: Kube) -> None:
    """A SIGKILLed agent leaves its nft table behind until `down`: its "refuse everything from
    its pods" must not catch this cluster's pods (tables know pods by address, and each cluster
    has a pod network of its own)."""
    kube = kube_ns
    live = int(_web(kube, {"app": "probe"}).split(".")[1]) - 64
    stale_octet = 64 + (live - 64 + 1) % 128  # another agent's, as address_octet gives
    stale_net = podnet.pod_network(stale_octet)
    deny_egress = {
        "metadata": {"namespace": "gone", "name": "deny"},
        "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": []},
    }
    dead_pods = [
        netpolicy.PodNet(
            uid=f"dead-{i}", namespace="gone", labels={}, ip=str(stale_net[256 + 2 + i])
        )
        for i in range(64)  # more pods than this test's cluster has started
    ]
    table = "gpulab_podnet_test_stale"
    script = netpolicy.compile_ruleset(table, dead_pods, [deny_egress], {"gone": {}})
    try:
        subprocess.run(["nft", "-f", "-"], input=script.encode(), check=True)
        with host_http_server(kube.cluster.host_address) as port:
            target = f"{kube.cluster.host_address}:{port}"
            assert _connect_from(kube, {"role": "client"}, target) == {target: "open"}
    finally:
        netpolicy.remove_table(table)
