"""Tenant isolation of GPUKubeSpawner's servers: who a server runs as, what it may do, whom it
may reach (issue 12), on by default whatever the profiles.

Every server runs as a fixed non-root uid/gid with `runAsNonRoot`, no privilege escalation, no
capabilities and the runtime's seccomp profile, and so does every container an admin adds to its
pod, so the pod passes Pod Security `restricted` (`pod_security`); the namespace gets the
`gpulab-singleuser` NetworkPolicy (and `gpulab-singleuser-jobs`: the same rules for the pods of GPU jobs, which run
with the same identity and hardening). The manifests are pure builders in `objects`; this mixin holds the options and
keeps the NetworkPolicy in place with the spawner's Kubernetes client.
"""

from __future__ import annotations

from typing import Any, ClassVar
from urllib.parse import urlparse

from kubernetes_asyncio.client import NetworkingV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from tornado import web
from traitlets import Bool, Callable, Dict, Integer, List, Unicode, Union, default, validate
from traitlets.config import Configurable

from gpulab.spawner.kube.objects import (
    CLOUD_METADATA_IP,
    MANAGED_BY,
    SERVER_POD_LABEL,
    container_security_context,
    pod_security_context,
    seccomp_profile,
    singleuser_network_policy,
)
from gpulab.spawner.kube.pod_security import harden_security_context
from gpulab.spawner.names import JOB_COMPONENT, PUSH_URL_ENV


class KubeIsolationMixin(Configurable):
    """Security contexts and the servers' NetworkPolicy for GPUKubeSpawner (before KubeSpawner in
    its bases, so these defaults replace KubeSpawner's)."""

    # attributes of KubeSpawner / Spawner this mixin uses
    api: Any
    namespace: str
    port: int
    hub: Any
    environment: Any
    component_label: str
    common_labels: dict[str, str]

    uid = Union(
        [Integer(), Callable()],
        default_value=1000,
        allow_none=True,
        config=True,
        help="""The uid the server container runs as (runAsUser). gpulab's default is 1000, the
        jovyan user of the Jupyter docker-stacks images; every user's pod runs as this uid, and
        pods are kept apart by the container runtime and the NetworkPolicy, not by uids. None:
        the image's USER (then `run_as_non_root` refuses an image that runs as root). 0 needs
        `run_as_non_root = False`, which Pod Security `restricted` refuses.""",
    )
    gid = Union(
        [Integer(), Callable()],
        default_value=100,
        allow_none=True,
        config=True,
        help="""The primary gid of the server container (runAsGroup); gpulab's default 100, the
        `users` group of the docker-stacks images.""",
    )
    fs_gid = Union(
        [Integer(), Callable()],
        default_value=100,
        allow_none=True,
        config=True,
        help="""fsGroup of the pod: volumes (the home PVC, the checkpoint key Secret) are
        group-owned by it, so the non-root server can write its home and read its key. gpulab's
        default 100, as `gid`.""",
    )
    run_as_non_root = Bool(
        True,
        config=True,
        help="""Set runAsNonRoot on the pod and the server container: the kubelet refuses to start
        a container that would run as uid 0 (CreateContainerConfigError). Turn off only for an
        image that must start as root, and only where the namespace is not restricted: where
        it enforces Pod Security `restricted` (the chart's default, `singleuser.podSecurity`)
        every pod without runAsNonRoot is refused (403 violates PodSecurity).""",
    )
    seccomp_profile = Unicode(
        "RuntimeDefault",
        config=True,
        help="""seccompProfile of the pod and server container: RuntimeDefault (the container
        runtime's default syscall filter), Localhost/<file> or Unconfined. Pod Security
        `restricted` admits RuntimeDefault and Localhost only: Unconfined works only where the
        namespace is not restricted.""",
    )
    drop_capabilities = List(
        Unicode(),
        ["ALL"],
        config=True,
        help="""Linux capabilities dropped from the server container (securityContext.capabilities
        .drop). A notebook server needs none. Pod Security `restricted` needs ALL dropped: a
        list without ALL works only where the namespace is not restricted.""",
    )

    @validate("seccomp_profile")
    def _check_seccomp(self, proposal: Any) -> str:
        try:
            seccomp_profile(proposal["value"])
        except ValueError as e:
            raise ValueError(f"GPUKubeSpawner.seccomp_profile: {e}") from None
        return str(proposal["value"])

    @validate("uid", "run_as_non_root")
    def _check_non_root(self, proposal: Any) -> Any:
        # config loading holds cross-validation until every option is set: both orders work
        uid = proposal["value"] if proposal["trait"].name == "uid" else self.uid
        non_root = (
            proposal["value"]
            if proposal["trait"].name == "run_as_non_root"
            else self.run_as_non_root
        )
        if non_root and isinstance(uid, int) and uid == 0:
            raise ValueError(
                "GPUKubeSpawner.uid = 0 contradicts GPUKubeSpawner.run_as_non_root = True: the "
                "kubelet would refuse to start every server; use a non-root uid (e.g. 1000)"
            )
        return proposal["value"]

    @default("pod_security_context")
    def _default_pod_security_context(self) -> dict[str, Any]:
        return pod_security_context(
            run_as_non_root=self.run_as_non_root, seccomp=self.seccomp_profile
        )

    @default("container_security_context")
    def _default_container_security_context(self) -> dict[str, Any]:
        return container_security_context(
            run_as_non_root=self.run_as_non_root,
            seccomp=self.seccomp_profile,
            drop_capabilities=self.drop_capabilities,
        )

    def harden_pod_containers(self, pod: Any) -> Any:
        """Every container of a server's pod (a V1Pod) but the server's own, which KubeSpawner
        hardens from the options above: the admin's `init_containers` (native sidecars among
        them) and `extra_containers` get the server container's securityContext under their
        own (`pod_security.harden_security_context`), so that the pod passes Pod Security
        `restricted` whatever they leave unset. `modify_pod_hook` runs after this."""
        containers = list(pod.spec.containers or [])
        if not containers:
            return pod
        serialize = self.api.api_client.sanitize_for_serialization
        hardening = serialize(containers[0].security_context) or {}
        for container in [*(pod.spec.init_containers or []), *containers[1:]]:
            own = serialize(container.security_context) if container.security_context else None
            container.security_context = harden_security_context(own, hardening)
        return pod

    network_policy = Bool(
        True,
        config=True,
        help="""Create (and keep up to date) the NetworkPolicy `network_policy_name` in each
        server namespace: servers accept connections only from the hub, the proxy and the metrics
        scraper, and reach only the hub API, DNS and (`network_policy_allow_internet`) the
        internet without private ranges and the cloud metadata address. Off when a Helm chart
        ships the same policy; a spawn fails rather than start a server the policy does not
        cover when the hub may not write NetworkPolicies.""",
    )
    network_policy_name = Unicode(
        "gpulab-singleuser", config=True, help="Name of the servers' NetworkPolicy."
    )
    network_policy_hub_labels = Dict(
        {"app": "jupyterhub", "component": "hub"},
        config=True,
        help="""Labels of the hub pod, the one destination servers may reach on the hub API port.
        The hub, proxy and metrics pods also need the label
        `hub.jupyter.org/network-access-singleuser: "true"` to reach the servers.""",
    )
    network_policy_hub_cidrs = List(
        Unicode(),
        [],
        config=True,
        help="""CIDRs of a hub and proxy running outside the cluster (e.g. ['10.0.0.5/32']):
        allowed to connect to the servers, and the servers to their hub API port.""",
    )
    network_policy_allow_internet = Bool(
        True,
        config=True,
        help="""Let servers reach non-private addresses (pip, conda, datasets). Private ranges
        and `cloud_metadata_ip` stay blocked either way.""",
    )
    cloud_metadata_ip = Unicode(
        CLOUD_METADATA_IP,
        config=True,
        help="""The cloud's instance metadata address, never reachable from a server (it hands
        out the node's credentials to anything that asks).""",
    )

    _network_policies_ready: ClassVar[set[tuple[str, str]]] = set()

    def _build_pod_labels(self, extra_labels: dict[str, str]) -> dict[str, str]:
        # KubeSpawner's labels of a server pod, and the one only gpulab's servers carry, which
        # the servers' NetworkPolicy selects (see SERVER_POD_LABEL)
        labels: dict[str, str] = super()._build_pod_labels(extra_labels)  # type: ignore[misc]
        key, value = SERVER_POD_LABEL
        return {**labels, key: value}

    def network_policy_manifest(self) -> dict[str, Any]:
        key, value = SERVER_POD_LABEL
        pod_selector = {key: value, "component": self.component_label}
        if "app" in self.common_labels:
            pod_selector["app"] = self.common_labels["app"]
        return singleuser_network_policy(
            self.network_policy_name,
            pod_selector=pod_selector,
            server_port=int(self.port or 8888),
            hub_selector=self.network_policy_hub_labels,
            hub_ports=self._hub_ports(),
            hub_cidrs=self.network_policy_hub_cidrs,
            allow_internet=self.network_policy_allow_internet,
            cloud_metadata_ip=self.cloud_metadata_ip,
            labels={**MANAGED_BY, "component": "gpulab-network-policy"},
        )

    def _hub_ports(self) -> list[int]:
        """The hub API's port, and the metrics service's where servers push their figures."""
        return [urlparse(self.hub.api_url).port or 8081, *self._push_ports()]

    def _push_ports(self) -> list[int]:
        """The metrics service's port where servers, job runs and Dask workers push their GPU
        figures (none when the hub runs no gpulab-metrics)."""
        push = self.environment.get(PUSH_URL_ENV) if isinstance(self.environment, dict) else None
        if not isinstance(push, str) or not push:
            return []
        parsed = urlparse(push)
        return [parsed.port or (443 if parsed.scheme == "https" else 80)]

    def job_network_policy_manifest(self) -> dict[str, Any]:
        """The NetworkPolicy of the job pods (`gpulab.spawner.kube.jobs`): the servers' rules
        for the pods of gpulab's Jobs, so a job is as unreachable from another tenant's pods as
        her server is (only the hub, the proxy and the metrics scraper connect)."""
        body = self.network_policy_manifest()
        selector = {"component": JOB_COMPONENT}
        if "app" in self.common_labels:
            selector["app"] = self.common_labels["app"]
        body["metadata"]["name"] = self.job_network_policy_name
        body["metadata"]["labels"] = {**MANAGED_BY, "component": "gpulab-job-network-policy"}
        body["spec"]["podSelector"] = {"matchLabels": selector}
        return body

    @property
    def job_network_policy_name(self) -> str:
        return f"{self.network_policy_name}-jobs"

    async def ensure_network_policy(self) -> None:
        """The servers' NetworkPolicy exists in this namespace as configured (once per hub
        process and namespace; a changed policy is replaced)."""
        await self._ensure_policy(self.network_policy_name, self.network_policy_manifest)

    async def ensure_job_network_policy(self) -> None:
        """The job pods' NetworkPolicy, as `ensure_network_policy` (before any job pod)."""
        await self._ensure_policy(self.job_network_policy_name, self.job_network_policy_manifest)

    async def _ensure_policy(self, name: str, manifest: Any) -> None:
        if not self.network_policy:
            return
        key = (self.namespace, name)
        if key in self._network_policies_ready:
            return
        api = NetworkingV1Api(self.api.api_client)
        body = manifest()
        try:
            try:
                current = await api.read_namespaced_network_policy(name, self.namespace)
            except ApiException as e:
                if e.status != 404:
                    raise
                try:
                    await api.create_namespaced_network_policy(self.namespace, body)
                except ApiException as e:
                    if e.status != 409:  # another spawn created it meanwhile
                        raise
            else:
                spec = self.api.api_client.sanitize_for_serialization(current.spec)
                if spec != body["spec"]:
                    await api.replace_namespaced_network_policy(name, self.namespace, body)
        except ApiException as e:
            raise web.HTTPError(
                500,
                f"Cannot create the NetworkPolicy {self.namespace}/{name} "
                f"({e.status} {e.reason}); the hub needs create/update on networkpolicies, or set "
                "GPUKubeSpawner.network_policy = False where a chart ships the policy",
            ) from None
        self._network_policies_ready.add(key)
