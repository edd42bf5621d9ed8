"""Services as in a real cluster: Debian's kube-proxy (iptables mode, in the nodes' network
namespace) routes ClusterIPs and NodePorts to the endpoints the real endpoint controller fills;
pods get the kubelet's Service variables and reach the API server through the `kubernetes`
Service with their ServiceAccount token, as in-cluster clients (KubeSpawner in a hub pod, the
Dask operator) do; two clusters on one machine keep their rules apart."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess
import sys
from collections.abc import Iterator

from gpulab.devcluster import DevCluster, NodeSpec
from gpulab.devcluster.agent import podnet
from gpulab.devcluster.build import KUBE_VERSION
from tests.harness.kube import CONNECT_SCRIPT, Kube, pod_manifest
from tests.harness.wait import wait_for

WEB = [sys.executable, "-m", "http.server", "8000", "--bind", "0.0.0.0"]

# a pod's in-cluster client: KUBERNETES_SERVICE_HOST/PORT, the mounted token and CA, as
# kubernetes' load_incluster_config reads them; prints the answers it got as JSON
IN_CLUSTER = r"""
import json, os, ssl, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
base = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
token = open(f"{sa}/token").read()
ns = open(f"{sa}/namespace").read()
tls = ssl.create_default_context(cafile=f"{sa}/ca.crt")  # verified: no insecure client
out = {"host": os.environ["KUBERNETES_SERVICE_HOST"]}
for path in ("/version", f"/api/v1/namespaces/{ns}/secrets"):
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=tls, timeout=10) as r:
            out[path] = [r.status, json.loads(r.read())]
    except urllib.error.HTTPError as e:
        out[path] = [e.code, json.loads(e.read())]
print(json.dumps(out), flush=True)
"""


# serves on 8000 and connects to its own Service (argv[1]) until it answers (30 s at most)
HAIRPIN = r"""
import http.server, socket, sys, threading, time
server = http.server.HTTPServer(("0.0.0.0", 8000), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
host, port = sys.argv[1].rsplit(":", 1)
deadline, seen = time.monotonic() + 30, "never tried"
while time.monotonic() < deadline:
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        seen = "open"
        break
    except OSError as e:
        seen = f"error {e}"
        time.sleep(0.5)
print(seen, flush=True)
"""


def _octet(cluster: DevCluster) -> int:
    return podnet.cluster_octet(cluster.state_dir / "agent")


@contextlib.contextmanager
def _web_service(kube: Kube, **spec: object) -> Iterator[tuple[dict, dict]]:
    """A ready web pod and a Service for it (port 80 -> 8000); yields (pod, service)."""
    labels = {"app": kube.name("svc")}
    name = labels["app"]
    m = pod_manifest(name, WEB, readinessProbe={"tcpSocket": {"port": 8000}, "periodSeconds": 1})
    m["metadata"]["labels"] = labels
    m["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": 8000}]
    kube.create_pod(m)
    pod = kube.wait_ready(name)
    body = {
        "metadata": {"name": name},
        "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": "http"}], **spec},
    }
    path = f"/api/v1/namespaces/{kube.ns}/services"
    service = kube.api("POST", path, body)
    try:
        yield pod, service
    finally:
        kube.api("DELETE", f"{path}/{name}")


def _http_status(url: str) -> int | None:
    done = subprocess.run(
        ["curl", "-s", "-m", "3", "-o", "/dev/null", "-w", "%{http_code}", url],
        capture_output=True,
        text=True,
    )
    return int(done.stdout) if done.stdout.isdigit() and done.stdout != "000" else None


def _connect_from_pod(kube: Kube, *targets: str) -> dict[str, str]:
    name = kube.name("probe")
    kube.create_pod(pod_manifest(name, [sys.executable, "-c", CONNECT_SCRIPT, *targets]))
    kube.wait_phase(name, "Succeeded", "Failed")
    return dict(json.loads(kube.cluster.logs(name, kube.ns).strip().splitlines()[-1]))


def test_a_cluster_ip_routes_to_the_services_pod_from_the_host_and_from_pods(kube: Kube) -> None:
    with _web_service(kube) as (_pod, service):
        ip = service["spec"]["clusterIP"]
        assert ipaddress.ip_address(ip) in podnet.service_cidr(_octet(kube.cluster))
        # kube-proxy syncs its rules a moment after the endpoint controller has filled them
        wait_for("the ClusterIP to answer", lambda: _http_status(f"http://{ip}/") == 200, 30)
        target = f"{ip}:80"
        assert _connect_from_pod(kube, target) == {target: "open"}


def test_a_pod_reaches_itself_through_its_own_service(kube: Kube) -> None:
    """Hairpin: the packet leaves the pod for the ClusterIP and comes back DNATed to it."""
    labels = {"app": kube.name("hairpin")}
    body = {
        "metadata": {"name": labels["app"]},
        "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8000}]},
    }
    path = f"/api/v1/namespaces/{kube.ns}/services"
    service = kube.api("POST", path, body)
    try:
        target = f"{service['spec']['clusterIP']}:80"
        m = pod_manifest(labels["app"], [sys.executable, "-c", HAIRPIN, target])
        m["metadata"]["labels"] = labels
        kube.create_pod(m)
        pod = kube.wait_phase(labels["app"], "Succeeded", "Failed", timeout=90)
        out = kube.cluster.logs(labels["app"], kube.ns)
        assert pod["status"]["phase"] == "Succeeded", out
        assert out.strip().splitlines()[-1] == "open"
    finally:
        kube.api("DELETE", f"{path}/{labels['app']}")


def test_a_service_without_endpoints_fails_at_once(kube: Kube) -> None:
    body = {
        "metadata": {"name": kube.name("empty")},
        "spec": {"selector": {"app": "nobody"}, "ports": [{"port": 80}]},
    }
    path = f"/api/v1/namespaces/{kube.ns}/services"
    service = kube.api("POST", path, body)
    try:
        target = f"{service['spec']['clusterIP']}:80"
        # the client fails at once (no route: the nodes' namespace holds no such address and
        # kube-proxy made no DNAT for it) rather than waiting for a timeout
        seen = _connect_from_pod(kube, target)[target]
        assert seen == "refused" or "No route to host" in seen, seen
    finally:
        kube.api("DELETE", f"{path}/{body['metadata']['name']}")


def test_a_node_port_answers_on_every_nodes_address(kube: Kube) -> None:
    with _web_service(kube, type="NodePort") as (_pod, service):
        port = service["spec"]["ports"][0]["nodePort"]
        nodes = kube.api("GET", "/api/v1/nodes")["items"]
        addresses = [
            a["address"]
            for n in nodes
            for a in n["status"]["addresses"]
            if a["type"] == "InternalIP"
        ]
        assert len(addresses) >= 2
        for address in addresses:
            wait_for(
                f"NodePort {port} on {address}",
                lambda a=address: _http_status(f"http://{a}:{port}/") == 200,
                30,
            )
        # a pod reaches it too, on any node's address
        target = f"{addresses[-1]}:{port}"
        assert _connect_from_pod(kube, target) == {target: "open"}


def test_pods_get_the_services_variables_and_reach_the_api_server_through_kubernetes(
    kube_ns: Kube,
) -> None:
    kube = kube_ns
    octet = _octet(kube.cluster)
    with _web_service(kube) as (_pod, service):
        name = kube.name("env")
        wait_for(  # the agent's Service watch follows the API a moment behind
            "the Service in a new pod's environment",
            lambda: _env_of(kube, name) or None,
            30,
        )
        env = _env_of(kube, name)
        var = service["metadata"]["name"].upper().replace("-", "_")
        assert env[f"{var}_SERVICE_HOST"] == service["spec"]["clusterIP"]
        assert env[f"{var}_SERVICE_PORT"] == "80"
        kubernetes = str(podnet.service_cidr(octet)[1])  # the service CIDR's first address
        assert env["KUBERNETES_SERVICE_HOST"] == kubernetes
        assert env["KUBERNETES_SERVICE_PORT"] == "443"
    probe = kube.name("incluster")
    kube.create_pod(pod_manifest(probe, [sys.executable, "-c", IN_CLUSTER]))
    pod = kube.wait_phase(probe, "Succeeded", "Failed")
    logs = kube.cluster.logs(probe, kube.ns)
    assert pod["status"]["phase"] == "Succeeded", logs
    out = json.loads(logs.strip().splitlines()[-1])
    assert out["host"] == kubernetes
    status, version = out["/version"]
    assert status == 200 and version["gitVersion"] == f"v{KUBE_VERSION}"
    # the pod's own identity, no more: its ServiceAccount may not read Secrets
    status, refusal = out[f"/api/v1/namespaces/{kube.ns}/secrets"]
    assert status == 403
    assert f"system:serviceaccount:{kube.ns}:default" in refusal["message"]


def _env_of(kube: Kube, name: str) -> dict[str, str]:
    """A fresh pod's environment (kube-created under a new name each call)."""
    probe = kube.name(name)
    kube.create_pod(pod_manifest(probe, ["env"]))
    kube.wait_phase(probe, "Succeeded", "Failed")
    lines = kube.cluster.logs(probe, kube.ns).splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    return (
        env
        if any(k.endswith("_SERVICE_HOST") and k != "KUBERNETES_SERVICE_HOST" for k in env)
        else {}
    )


def test_enable_service_links_false_keeps_only_the_api_server(kube: Kube) -> None:
    with _web_service(kube) as (_pod, service):
        var = service["metadata"]["name"].upper().replace("-", "_") + "_SERVICE_HOST"
        wait_for("the Service in a pod's environment", lambda: var in _env_of(kube, "on"), 30)
        probe = kube.name("nolinks")
        m = pod_manifest(probe, ["env"])
        m["spec"]["enableServiceLinks"] = False
        kube.create_pod(m)
        kube.wait_phase(probe, "Succeeded", "Failed")
        env = dict(
            line.split("=", 1)
            for line in kube.cluster.logs(probe, kube.ns).splitlines()
            if "=" in line
        )
        assert var not in env
        assert "KUBERNETES_SERVICE_HOST" in env


def test_two_clusters_on_one_machine_each_route_their_own_services(
    kube: Kube, make_dev_cluster
) -> None:  # type: ignore[no-untyped-def]
    """kube-proxy's chains have fixed names: each cluster's live in its own nodes' namespace, so
    a second cluster's kube-proxy leaves the first's Services alone (and the reverse)."""
    other: DevCluster = make_dev_cluster([NodeSpec("svc-0", gpus=0)], name="services")
    assert _octet(other) != _octet(kube.cluster)
    other_kube = Kube(other)
    try:
        with _web_service(kube) as (_p1, mine), _web_service(other_kube) as (_p2, theirs):
            for service in (mine, theirs):
                ip = service["spec"]["clusterIP"]
                wait_for(f"ClusterIP {ip}", lambda ip=ip: _http_status(f"http://{ip}/") == 200, 30)
            # and a pod of one cluster cannot reach the other's network
            target = f"{theirs['spec']['clusterIP']}:80"
            assert _connect_from_pod(kube, target)[target] != "open"
        host_rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
        assert "KUBE-SERVICES" not in host_rules  # nothing of either cluster's on this machine
    finally:
        other_kube.close()
