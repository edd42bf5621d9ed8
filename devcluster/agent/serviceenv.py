"""The Service environment variables a kubelet gives every container (``enableServiceLinks``).

For each Service of the pod's namespace that has a ClusterIP (headless and ExternalName Services
have none), as the kubelet's ``getServiceEnvVarMap`` does:

- ``<NAME>_SERVICE_HOST``, ``<NAME>_SERVICE_PORT`` (the first port),
  ``<NAME>_SERVICE_PORT_<PORTNAME>`` for every named port;
- Docker-link style: ``<NAME>_PORT=<proto>://<ip>:<first port>``, and for every port
  ``<NAME>_PORT_<port>_<PROTO>`` with ``_PROTO``, ``_PORT``, ``_ADDR``;

``<NAME>`` is the Service name upper-cased with dashes as underscores. ``enableServiceLinks:
false`` keeps only the ``kubernetes`` Service of the ``default`` namespace (the API server), which
every pod gets. A pod's own ``env`` wins over these (the caller puts them underneath).

The agent computes them when a container starts, from the Services a watch has seen by then
(`ServiceLister`), as the kubelet does from its informer: a Service created a moment before a pod
may be missing from the pod's environment there too. ClusterIPs route through the cluster's
kube-proxy (`podnet`), so ``KUBERNETES_SERVICE_HOST`` names the ``kubernetes`` Service's
ClusterIP, which kube-proxy forwards to the API server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .kube import watch_forever

MASTER_NAMESPACE = "default"
MASTER_SERVICE = "kubernetes"


def _env_name(service_name: str) -> str:
    return service_name.upper().replace("-", "_")


def _service_vars(service: Mapping[str, Any]) -> dict[str, str]:
    spec = service.get("spec") or {}
    ip = spec.get("clusterIP") or ""
    ports = spec.get("ports") or []
    if ip in ("", "None") or not ports:
        return {}
    name = _env_name(service["metadata"]["name"])
    first = ports[0]
    out = {
        f"{name}_SERVICE_HOST": ip,
        f"{name}_SERVICE_PORT": str(first["port"]),
        f"{name}_PORT": f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}",
    }
    for port in ports:
        if port.get("name"):
            out[f"{name}_SERVICE_PORT_{_env_name(port['name'])}"] = str(port["port"])
        proto = port.get("protocol", "TCP")
        prefix = f"{name}_PORT_{port['port']}_{proto.upper()}"
        out[prefix] = f"{proto.lower()}://{ip}:{port['port']}"
        out[f"{prefix}_PROTO"] = proto.lower()
        out[f"{prefix}_PORT"] = str(port["port"])
        out[f"{prefix}_ADDR"] = ip
    return out


def service_environment(
    services: Iterable[Mapping[str, Any]], namespace: str, *, enable_service_links: bool = True
) -> dict[str, str]:
    """The variables for a container of a pod in `namespace` (pure: Services as the API gives).

    As the kubelet: a Service of the pod's own namespace named like the master Service replaces
    it (both are keyed by name)."""
    chosen: dict[str, Mapping[str, Any]] = {}
    for service in services:
        meta = service["metadata"]
        if meta["namespace"] == MASTER_NAMESPACE and meta["name"] == MASTER_SERVICE:
            chosen.setdefault(meta["name"], service)
        elif enable_service_links and meta["namespace"] == namespace:
            chosen[meta["name"]] = service
    env: dict[str, str] = {}
    for service in chosen.values():
        env.update(_service_vars(service))
    return env


class ServiceLister:
    """Every Service of the cluster, kept current by a watch (`run`)."""

    def __init__(self) -> None:
        self._services: dict[tuple[str, str], Mapping[str, Any]] = {}

    def services(self) -> list[Mapping[str, Any]]:
        return list(self._services.values())

    def environment(self, namespace: str, *, enable_service_links: bool = True) -> dict[str, str]:
        return service_environment(
            self.services(), namespace, enable_service_links=enable_service_links
        )

    async def run(self, core: Any) -> None:
        async def handle(event: str, service: dict[str, Any]) -> None:
            key = (service["metadata"]["namespace"], service["metadata"]["name"])
            if event == "DELETED":
                self._services.pop(key, None)
            else:
                self._services[key] = service

        async def forget(_items: list[dict[str, Any]]) -> None:
            self._services.clear()  # a relist replaces what was known

        await watch_forever(
            "services (environment)",
            core.list_service_for_all_namespaces,
            handle,
            resync=forget,
        )
