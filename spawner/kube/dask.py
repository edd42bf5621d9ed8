"""The Kubernetes Dask executor: a cluster's scheduler and workers as the dask-kubernetes
operator's objects in the owner's namespace (the contract: `gpulab.hub.daskservice.DaskExecutor`).

`GPUKubeSpawner.dask_executor` hands the hub's cluster service a `KubeDaskExecutor`. The manifests
are the pure builders of `dask_objects`; the operator (`dask_operator`) makes pods of them; this
module talks to the API server with the hub's own client (the notebook holds no Kubernetes
permission) and decides when a pod has ended (reading pods and nodes with `dask_outcomes`).

start_scheduler  the cluster's NetworkPolicies (before any pod: never up unprotected), its TLS
                 Secret, then its `DaskCluster` (scheduler on the scheduler's placement, default
                 worker group at 0); returns once the scheduler's Service has a ClusterIP and a
                 mutual-TLS handshake with it succeeds from the hub, with `tls://<ClusterIP>:8786`
                 (the address the hub, the workers and the owner's pods reach alike). A start
                 that fails deletes what it made.
start_worker     one `DaskWorkerGroup` of one replica per worker, its pod holding the worker's
                 placement (and, where the hub gives one, the worker's GPU report from a Secret
                 of its own, owned by the group); returns once the operator made its pod.
stop             deletes the worker group and its report Secret (or, for the scheduler, the
                 DaskCluster, its Secret and policies), SIGTERMs the pods (their grace:
                 `grace_seconds`), force-deletes what is left after it and pods of lost nodes
                 at once (no kubelet will confirm), and returns only when no pod of it exists.
running          the object exists, is not being deleted, and no pod of it sits on a lost node
                 (NotReady or gone for `node_failure_seconds`); the Deployment the operator made
                 restarts a crashed process, as a kubelet does.
exit_reason      "node X was lost", the container's last end ("exited with status 1",
                 "OOMKilled"), or that the object was deleted by someone else.

Handles are the objects' names (`dask_outcomes.KubeDaskHandle`), so a restarted hub finds them
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from kubernetes_asyncio.client import (
    AppsV1Api,
    CoreV1Api,
    CustomObjectsApi,
    NetworkingV1Api,
    V1DeleteOptions,
)
from kubernetes_asyncio.client.exceptions import ApiException

from gpulab.hub.allocator import Placement
from gpulab.hub.dask import Cluster, Worker
from gpulab.hub.daskservice.executor import ClusterTLS, SchedulerStarted
from gpulab.hub.profiles import Profile
from gpulab.spawner.kube.dask_network import dask_client_network_policy, dask_network_policy
from gpulab.spawner.kube.dask_objects import dask_cluster_manifest, dask_worker_group_manifest
from gpulab.spawner.kube.dask_outcomes import (
    KubeDaskHandle,
    container_end_reason,
    node_lost_for,
    pod_ready,
)
from gpulab.spawner.kube.dask_secrets import (
    report_owner_patch,
    report_secret_manifest,
    tls_secret_manifest,
)
from gpulab.spawner.kube.dask_settings import (
    DASHBOARD_PORT,
    SCHEDULER_PORT,
    KubeDaskSettings,
    client_network_policy_name,
    cluster_name,
    network_policy_name,
    report_secret_name,
    scheduler_name,
    tls_secret_name,
    worker_group_name,
)
from gpulab.spawner.kube.gpu_resources import PlacedPod
from gpulab.spawner.kube.job_outcomes import pod_is_live, waiting_reason

log = logging.getLogger("gpulab.dask.kube")

GROUP, VERSION = "kubernetes.dask.org", "v1"
#: how long a stop waits for the DaskCluster / DaskWorkerGroup itself once its pods are gone
OBJECT_GONE_SECONDS = 15.0


class KubeDaskError(Exception):
    """A scheduler or worker could not be started or stopped; the message says why."""


@dataclass(frozen=True)
class KubeDaskTarget:
    """What the executor needs of an owner's backend (`GPUKubeSpawner.dask_target`): the hub's
    client, the pods' settings (her namespace, image, uid, hardening), her profiles, the pod
    side of a placement (`placed_job_pod`) and when a node counts as lost."""

    api_client: Any
    settings: KubeDaskSettings
    profile: Callable[[str], Profile | None]
    placed_pod: Callable[[Profile, Placement], PlacedPod]
    priority_class: Callable[[str], str]
    node_failure_seconds: float = 30.0
    start_timeout: float = 120.0


# -- the executor ----------------------------------------------------------------------------------


class KubeDaskExecutor:
    """Schedulers and workers as DaskCluster / DaskWorkerGroup objects (module docstring).
    `target_for(owner)`: her `KubeDaskTarget`."""

    def __init__(
        self,
        *,
        target_for: Callable[[str], Awaitable[KubeDaskTarget]],
        poll_seconds: float = 0.25,
    ) -> None:
        self.target_for = target_for
        self.poll_seconds = poll_seconds

    # -- start ---------------------------------------------------------------------------------

    async def start_scheduler(
        self, cluster: Cluster, placement: Placement, tls: ClusterTLS
    ) -> SchedulerStarted:
        target = await self.target_for(cluster.owner)
        s = target.settings
        handle = KubeDaskHandle(
            cluster.owner, cluster.id, s.namespace, cluster_name(cluster.owner, cluster.id)
        )
        api = target.api_client
        core, net, custom = CoreV1Api(api), NetworkingV1Api(api), CustomObjectsApi(api)
        try:
            await self._delete_cluster_objects(target, handle, grace=0)  # a start left half done
            for policy in (
                dask_network_policy(cluster.owner, cluster.id, s),
                dask_client_network_policy(cluster.owner, cluster.id, s),
            ):
                await net.create_namespaced_network_policy(s.namespace, cast(Any, policy))
            secret = tls_secret_manifest(cluster.owner, cluster.id, tls.cert_pem, tls.key_pem, s)
            await core.create_namespaced_secret(s.namespace, cast(Any, secret))
            body = dask_cluster_manifest(
                cluster.owner,
                cluster.id,
                placement=placement,
                settings=s,
                priority_class_name=target.priority_class(placement.request.priority),
            )
            await custom.create_namespaced_custom_object(
                GROUP, VERSION, s.namespace, "daskclusters", body
            )
            ip = await self._wait_scheduler(target, handle, tls)
        except BaseException as e:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._delete_cluster_objects(target, handle, grace=0))
            if isinstance(e, ApiException):
                raise KubeDaskError(
                    f"the cluster refused cluster {cluster.id}'s objects ({e.status} {e.reason}):"
                    f" {_detail(e)}"
                ) from None
            raise
        log.info(
            "dask cluster %d: scheduler %s/%s at %s", cluster.id, s.namespace, handle.cluster, ip
        )
        return SchedulerStarted(
            handle=handle.to_dict(),
            address=f"tls://{ip}:{SCHEDULER_PORT}",
            dashboard_url=f"http://{ip}:{DASHBOARD_PORT}/",
        )

    async def _wait_scheduler(
        self, target: KubeDaskTarget, handle: KubeDaskHandle, tls: ClusterTLS
    ) -> str:
        """The scheduler Service's ClusterIP, once a TLS handshake through it succeeds."""
        from distributed.comm.core import connect
        from distributed.security import Security

        # distributed is untyped: its calls are Any here
        security: Any = Security(  # type: ignore[no-untyped-call]
            tls_ca_file=tls.cert_pem,
            tls_client_cert=tls.cert_pem,
            tls_client_key=tls.key_pem,
            require_encryption=True,
        )
        core = CoreV1Api(target.api_client)
        deadline = time.monotonic() + target.start_timeout
        why = "the operator made no scheduler Service (is it running?)"
        while time.monotonic() < deadline:
            ip = await self._service_ip(core, handle)
            pods = await self._pods(core, handle)
            if pods:
                pod = pods[-1]
                why = (
                    waiting_reason(pod)
                    or container_end_reason(pod)
                    or f"pod {pod['metadata']['name']} is {pod['status'].get('phase')}, not Ready"
                )
            elif ip:
                why = "the operator made no scheduler pod"
            if ip and any(pod_ready(p) for p in pods):
                try:
                    comm = await connect(  # type: ignore[no-untyped-call]
                        f"tls://{ip}:{SCHEDULER_PORT}",
                        timeout=5,
                        **security.get_connection_args("client"),
                    )
                except OSError as e:
                    why = f"the scheduler refused TLS: {e}"
                else:
                    await comm.close()
                    return ip
            await asyncio.sleep(self.poll_seconds)
        raise KubeDaskError(
            f"the scheduler of cluster {handle.cluster_id} did not accept TLS connections within "
            f"{target.start_timeout:.0f} s: {why}"
        )

    async def start_worker(
        self,
        cluster: Cluster,
        worker: Worker,
        placement: Placement,
        scheduler_address: str,
        tls: ClusterTLS,
        report: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        target = await self.target_for(cluster.owner)
        profile = target.profile(cluster.spec.profile)
        if profile is None:
            raise KubeDaskError(f"profile {cluster.spec.profile!r} no longer exists")
        s = target.settings
        name = cluster_name(cluster.owner, cluster.id)
        handle = KubeDaskHandle(cluster.owner, cluster.id, s.namespace, name, worker.number)
        body = dask_worker_group_manifest(
            cluster.owner,
            cluster.id,
            worker.number,
            placement=placement,
            pod=target.placed_pod(profile, placement),
            scheduler_address=scheduler_address,
            cpu_milli=round((profile.cpu_limit or 0) * 1000),
            memory_mib=profile.mem_limit_mib or 0,
            environment=cluster.spec.environment,
            settings=s,
            report_keys=tuple(report or ()),
        )
        core, custom = CoreV1Api(target.api_client), CustomObjectsApi(target.api_client)
        try:
            await self._stop_worker_objects(target, handle, grace=0)  # left by an earlier start
            if report:
                # the token in a Secret of the owner's namespace, referenced by the pod, never a
                # literal of the group, the Deployment or the pod (dask_secrets' docstring)
                secret = report_secret_manifest(cluster.owner, cluster.id, worker.number, report, s)
                await core.create_namespaced_secret(s.namespace, cast(Any, secret))
            made = await custom.create_namespaced_custom_object(
                GROUP, VERSION, s.namespace, "daskworkergroups", body
            )
            if report:
                await core.patch_namespaced_secret(
                    secret["metadata"]["name"], s.namespace, report_owner_patch(made)
                )
            deadline = time.monotonic() + target.start_timeout
            while not await self._pods(core, handle):
                if time.monotonic() > deadline:
                    why = await self._replica_failure(target, handle)
                    raise KubeDaskError(
                        f"no pod of worker {worker.number} of cluster {cluster.id} was made "
                        f"within {target.start_timeout:.0f} s: "
                        f"{why or 'the operator made no Deployment (is it running?)'}"
                    )
                await asyncio.sleep(self.poll_seconds)
        except BaseException as e:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._stop_worker_objects(target, handle, grace=0))
            if isinstance(e, ApiException):
                raise KubeDaskError(
                    f"the cluster refused worker {worker.number} of cluster {cluster.id} "
                    f"({e.status} {e.reason}): {_detail(e)}"
                ) from None
            raise
        log.info(
            "dask cluster %d: worker %d (%s) on %s",
            cluster.id,
            worker.number,
            body["metadata"]["name"],
            placement.node,
        )
        return handle.to_dict()

    # -- stop ----------------------------------------------------------------------------------

    async def stop(self, handle: Mapping[str, Any], grace_seconds: float) -> None:
        h = KubeDaskHandle.from_dict(handle)
        target = await self.target_for(h.owner)
        if h.worker is None:
            await self._delete_cluster_objects(target, h, grace=grace_seconds)
        else:
            await self._stop_worker_objects(target, h, grace=grace_seconds)

    async def _stop_worker_objects(
        self, target: KubeDaskTarget, h: KubeDaskHandle, grace: float
    ) -> None:
        assert h.worker is not None
        custom = CustomObjectsApi(target.api_client)
        await _delete(
            custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                h.namespace,
                "daskworkergroups",
                worker_group_name(h.cluster, h.worker),
                # Background: a foreground deletion of a custom resource waits for the garbage
                # collector to watch its kind (up to its 30 s discovery resync after the CRDs
                # were applied); the Deployments it owns are deleted here, right after
                body=V1DeleteOptions(propagation_policy="Background"),
            )
        )
        await self._wait_pods_gone(target, h, grace)
        await self._wait_object_gone(target, h)
        # the garbage collector would take it with the group; not waited for (nor for a report
        # of a start that failed before the group was made)
        core = CoreV1Api(target.api_client)
        await _delete(
            core.delete_namespaced_secret(report_secret_name(h.cluster, h.worker), h.namespace)
        )

    async def _wait_object_gone(self, target: KubeDaskTarget, h: KubeDaskHandle) -> None:
        """Its pods are gone (what the share waits for); the object itself follows once the
        garbage collector and the operator's finalizer are done: waited for briefly, so that
        `exit_reason` and a new start see it gone, but never held up by an absent operator."""
        deadline = time.monotonic() + OBJECT_GONE_SECONDS
        while await self._object(target, h) is not None:
            if time.monotonic() > deadline:
                log.warning("%s is still being deleted; its pods are gone", h)
                return
            await asyncio.sleep(self.poll_seconds)

    async def _delete_cluster_objects(
        self, target: KubeDaskTarget, h: KubeDaskHandle, grace: float
    ) -> None:
        """The DaskCluster (its scheduler, Service and default group go with it), then its
        Secret and policies once no pod of it is left."""
        api = target.api_client
        custom, core, net = CustomObjectsApi(api), CoreV1Api(api), NetworkingV1Api(api)
        await _delete(
            custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                h.namespace,
                "daskclusters",
                h.cluster,
                body=V1DeleteOptions(propagation_policy="Background"),  # as for worker groups
            )
        )
        # what the operator made of it, without waiting for the garbage collector: the default
        # worker group, the scheduler's Service, and (in `_wait_pods_gone`) its Deployment
        await _delete(
            custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                h.namespace,
                "daskworkergroups",
                f"{h.cluster}-default",
                body=V1DeleteOptions(propagation_policy="Background"),
            )
        )
        await _delete(core.delete_namespaced_service(scheduler_name(h.cluster), h.namespace))
        await self._wait_pods_gone(target, h, grace)
        await self._wait_object_gone(target, h)
        await _delete(core.delete_namespaced_secret(tls_secret_name(h.cluster), h.namespace))
        for name in (network_policy_name(h.cluster), client_network_policy_name(h.cluster)):
            await _delete(net.delete_namespaced_network_policy(name, h.namespace))

    async def _wait_pods_gone(
        self, target: KubeDaskTarget, h: KubeDaskHandle, grace: float
    ) -> None:
        """Delete the handle's Deployments and pods (SIGTERM, `grace` seconds, then force; pods
        of lost nodes at once) until none exists."""
        api = target.api_client
        core, apps = CoreV1Api(api), AppsV1Api(api)
        selector = h.pod_selector
        began = time.monotonic()
        asked: set[str] = set()
        while True:
            # the operator's Deployments go with their owner (the garbage collector's
            # foreground deletion); deleting them here too does not wait for it
            deployments = await apps.list_namespaced_deployment(
                h.namespace, label_selector=selector
            )
            for deployment in deployments.items or []:
                if deployment.metadata.deletion_timestamp is None:
                    await _delete(
                        apps.delete_namespaced_deployment(
                            deployment.metadata.name,
                            h.namespace,
                            body=V1DeleteOptions(propagation_policy="Foreground"),
                        )
                    )
            pods = await self._pods(core, h)
            if not pods and not deployments.items:
                return
            overdue = time.monotonic() - began > grace
            for pod in pods:
                name = pod["metadata"]["name"]
                node = (pod.get("spec") or {}).get("nodeName")
                lost = bool(node) and await self._node_lost(core, str(node), target)
                if lost or overdue or not pod_is_live(pod):
                    if f"{name}/force" not in asked:
                        asked.add(f"{name}/force")
                        await _delete(
                            core.delete_namespaced_pod(
                                name, h.namespace, body=V1DeleteOptions(grace_period_seconds=0)
                            )
                        )
                elif name not in asked:
                    asked.add(name)
                    await _delete(
                        core.delete_namespaced_pod(
                            name,
                            h.namespace,
                            body=V1DeleteOptions(grace_period_seconds=max(1, int(grace))),
                        )
                    )
            if time.monotonic() - began > grace + 60:
                names = ", ".join(p["metadata"]["name"] for p in pods)
                raise KubeDaskError(f"pods {names} did not stop within {grace + 60:.0f} s")
            await asyncio.sleep(self.poll_seconds)

    # -- running, exit_reason ------------------------------------------------------------------

    async def running(self, handle: Mapping[str, Any]) -> bool:
        h = KubeDaskHandle.from_dict(handle)
        target = await self.target_for(h.owner)
        obj = await self._object(target, h)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return False
        core = CoreV1Api(target.api_client)
        for pod in await self._pods(core, h):
            node = (pod.get("spec") or {}).get("nodeName")
            if node and await self._node_lost(core, node, target):
                return False
        return True

    async def exit_reason(self, handle: Mapping[str, Any]) -> str:
        h = KubeDaskHandle.from_dict(handle)
        target = await self.target_for(h.owner)
        core = CoreV1Api(target.api_client)
        pods = await self._pods(core, h)
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node and await self._node_lost(core, node, target):
                return f"node {node} was lost"
        for pod in reversed(pods):
            reason = container_end_reason(pod)
            if reason:
                return reason
        if await self._object(target, h) is None:
            kind = "DaskCluster" if h.worker is None else "DaskWorkerGroup"
            return f"its {kind} was deleted"
        return ""

    # -- API calls -----------------------------------------------------------------------------

    async def _replica_failure(self, target: KubeDaskTarget, h: KubeDaskHandle) -> str:
        """Why the operator's Deployment of `h` made no pod, as the Deployment controller says
        (e.g. "pods ... is forbidden: no PriorityClass with name ... was found"); "" when it
        made no Deployment."""
        apps = AppsV1Api(target.api_client)
        listing = await apps.list_namespaced_deployment(h.namespace, label_selector=h.pod_selector)
        for deployment in listing.items or []:
            for condition in deployment.status.conditions or []:
                if condition.type == "ReplicaFailure" and condition.status == "True":
                    return str(condition.message or condition.reason)[:300]
        if listing.items:
            return "its Deployment exists but made no pod yet"
        return ""

    async def _object(self, target: KubeDaskTarget, h: KubeDaskHandle) -> dict[str, Any] | None:
        custom = CustomObjectsApi(target.api_client)
        plural, name = (
            ("daskclusters", h.cluster)
            if h.worker is None
            else ("daskworkergroups", worker_group_name(h.cluster, h.worker))
        )
        try:
            found: dict[str, Any] = await custom.get_namespaced_custom_object(
                GROUP, VERSION, h.namespace, plural, name
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return found

    async def _pods(self, core: Any, h: KubeDaskHandle) -> list[dict[str, Any]]:
        listing = await core.list_namespaced_pod(h.namespace, label_selector=h.pod_selector)
        pods = [core.api_client.sanitize_for_serialization(p) for p in listing.items or []]
        return sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")

    async def _service_ip(self, core: Any, h: KubeDaskHandle) -> str:
        try:
            service = await core.read_namespaced_service(scheduler_name(h.cluster), h.namespace)
        except ApiException as e:
            if e.status == 404:
                return ""
            raise
        ip = service.spec.cluster_ip
        return "" if not ip or ip == "None" else str(ip)

    async def _node_lost(self, core: Any, node: str, target: KubeDaskTarget) -> bool:
        try:
            found = core.api_client.sanitize_for_serialization(await core.read_node(node))
        except ApiException as e:
            if e.status != 404:
                raise
            found = None
        return node_lost_for(found, time.time()) > target.node_failure_seconds


def _detail(e: ApiException) -> str:
    detail = e.body.decode(errors="replace") if isinstance(e.body, bytes) else e.body
    return str(detail or "")[:300]


async def _delete(call: Awaitable[Any]) -> None:
    """An API deletion; a 404 (already gone) is what was wanted."""
    try:
        await call
    except ApiException as e:
        if e.status != 404:
            raise


__all__ = ["KubeDaskError", "KubeDaskExecutor", "KubeDaskTarget"]
