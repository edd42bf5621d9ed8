"""Service environment variables as the kubelet sets them (enableServiceLinks)."""

from __future__ import annotations

from gpulab.devcluster.agent.serviceenv import service_environment


def _svc(ns: str, name: str, ip: str, *ports: dict) -> dict:
    return {
        "metadata": {"namespace": ns, "name": name},
        "spec": {"clusterIP": ip, "ports": list(ports)},
    }


MASTER = _svc(
    "default", "kubernetes", "10.96.0.1", {"name": "https", "port": 443, "protocol": "TCP"}
)
HUB = _svc(
    "jhub",
    "proxy-public",
    "10.96.4.7",
    {"name": "http", "port": 80, "protocol": "TCP"},
    {"name": "metrics", "port": 9090},
)
HEADLESS = _svc("jhub", "dask", "None", {"port": 8786})
OTHER_NS = _svc("bob", "secret-svc", "10.96.9.9", {"port": 80})


def test_a_pod_gets_its_namespaces_services_and_the_api_server() -> None:
    env = service_environment([MASTER, HUB, HEADLESS, OTHER_NS], "jhub")
    assert env["PROXY_PUBLIC_SERVICE_HOST"] == "10.96.4.7"
    assert env["PROXY_PUBLIC_SERVICE_PORT"] == "80"  # the first port
    assert env["PROXY_PUBLIC_SERVICE_PORT_HTTP"] == "80"
    assert env["PROXY_PUBLIC_SERVICE_PORT_METRICS"] == "9090"
    assert env["PROXY_PUBLIC_PORT"] == "tcp://10.96.4.7:80"
    assert env["PROXY_PUBLIC_PORT_9090_TCP"] == "tcp://10.96.4.7:9090"
    assert env["PROXY_PUBLIC_PORT_9090_TCP_PROTO"] == "tcp"
    assert env["PROXY_PUBLIC_PORT_9090_TCP_PORT"] == "9090"
    assert env["PROXY_PUBLIC_PORT_9090_TCP_ADDR"] == "10.96.4.7"
    assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"
    assert env["KUBERNETES_SERVICE_PORT_HTTPS"] == "443"
    # headless Services have no address to give; another namespace's Services are not named
    assert not any(k.startswith(("DASK_", "SECRET_SVC_")) for k in env)


def test_without_service_links_only_the_api_server_is_named() -> None:
    env = service_environment([MASTER, HUB], "jhub", enable_service_links=False)
    assert {k for k in env if not k.startswith("KUBERNETES_")} == set()
    assert env["KUBERNETES_PORT"] == "tcp://10.96.0.1:443"


def test_a_namespaces_own_kubernetes_service_replaces_the_masters() -> None:
    own = _svc("jhub", "kubernetes", "10.96.7.7", {"port": 8443})
    for order in ([MASTER, own], [own, MASTER]):
        assert service_environment(order, "jhub")["KUBERNETES_SERVICE_HOST"] == "10.96.7.7"
