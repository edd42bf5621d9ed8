"""Node registration and heartbeats: the Node object, its Ready condition and its Lease."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kubernetes_asyncio import client

from .. import spec as nodespec
from ..spec import NodeSpec
from .kube import JSON_PATCH, MERGE, STRATEGIC, log, now, now_micro, raw, status_of
from .kubeletapi import KUBELET_PORT

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_SECONDS = 40
# taints the node controller puts on a node whose heartbeats stopped
FAILURE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


class NodeHeartbeat:
    """Registers one simulated node and keeps it Ready while running."""

    def __init__(
        self,
        api: client.ApiClient,
        spec: NodeSpec,
        *,
        internal_ip: str,
        pod_cidr: str,
        interval_seconds: float,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.coord = client.CoordinationV1Api(api)
        self.spec = spec
        self.ip = internal_ip
        self.pod_cidr = pod_cidr
        self.interval = interval_seconds
        self.uid: str | None = None
        self.ready_since = now()

    def _status(self) -> dict[str, Any]:
        ts = now()
        since = self.ready_since

        def cond(type_: str, value: str, reason: str, message: str) -> dict[str, str]:
            return {
                "type": type_,
                "status": value,
                "lastHeartbeatTime": ts,
                "lastTransitionTime": since,
                "reason": reason,
                "message": message,
            }

        cap = nodespec.capacity(self.spec)
        return {
            "capacity": cap,
            "allocatable": cap,
            "conditions": [
                cond(
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory",
                    "kubelet has sufficient memory available",
                ),
                cond(
                    "DiskPressure",
                    "False",
                    "KubeletHasNoDiskPressure",
                    "kubelet has no disk pressure",
                ),
                cond(
                    "PIDPressure",
                    "False",
                    "KubeletHasSufficientPID",
                    "kubelet has sufficient PID available",
                ),
                cond("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.ip},
                {"type": "Hostname", "address": self.spec.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": KUBELET_PORT}},
            "nodeInfo": nodespec.node_info(self.spec),
            "declaredFeatures": list(nodespec.DECLARED_FEATURES),
        }

    async def register(self) -> None:
        """Create the Node (or update labels/taints of an existing one) and post Ready."""
        self.ready_since = now()
        manifest = nodespec.node_manifest(self.spec, internal_ip=self.ip, pod_cidr=self.pod_cidr)
        try:
            node = await raw(self.core.create_node(manifest, _preload_content=False))
        except Exception as e:
            if status_of(e) != 409:
                raise
            patch = {
                "metadata": {
                    "labels": manifest["metadata"]["labels"],
                    "annotations": manifest["metadata"]["annotations"],
                },
                "spec": {"taints": nodespec.taints(self.spec) or None, "unschedulable": None},
            }
            node = await raw(
                self.core.patch_node(
                    self.spec.name, patch, _content_type=MERGE, _preload_content=False
                )
            )
        self.uid = node["metadata"]["uid"]
        await self.heartbeat()
        log.info(
            "node %s registered (%s, %s)", self.spec.name, self.ip, nodespec.capacity(self.spec)
        )

    async def heartbeat(self) -> None:
        # the Lease first: one small write, and what the node controller reads when it is newer
        await self._renew_lease()
        node = await raw(
            self.core.patch_node_status(
                self.spec.name,
                {"status": self._status()},
                _content_type=STRATEGIC,
                _preload_content=False,
            )
        )
        await self._drop_failure_taints(node)

    async def _renew_lease(self) -> None:
        name = self.spec.name
        spec = {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_DURATION_SECONDS,
            "renewTime": now_micro(),
        }
        try:
            await raw(
                self.coord.patch_namespaced_lease(
                    name,
                    LEASE_NAMESPACE,
                    {"spec": spec},
                    _content_type=MERGE,
                    _preload_content=False,
                )
            )
        except Exception as e:
            if status_of(e) != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": name,
                    "namespace": LEASE_NAMESPACE,
                    "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": name, "uid": self.uid}
                    ]
                    if self.uid
                    else [],
                },
                "spec": spec,
            }
            await raw(
                self.coord.create_namespaced_lease(LEASE_NAMESPACE, body, _preload_content=False)
            )

    async def _drop_failure_taints(self, node: dict[str, Any]) -> None:
        """Remove unreachable/not-ready taints the node gained while its heartbeats were stopped."""
        taints = (node.get("spec") or {}).get("taints") or []
        keep = [t for t in taints if t.get("key") not in FAILURE_TAINTS]
        if len(keep) == len(taints):
            return
        patch = [
            {
                "op": "test",
                "path": "/metadata/resourceVersion",
                "value": node["metadata"]["resourceVersion"],
            },
            {"op": "replace", "path": "/spec/taints", "value": keep},
        ]
        with contextlib.suppress(Exception):  # a conflict: the next heartbeat tries again
            await raw(
                self.core.patch_node(
                    self.spec.name, patch, _content_type=JSON_PATCH, _preload_content=False
                )
            )
            log.info(
                "node %s: removed taints %s",
                self.spec.name,
                [t["key"] for t in taints if t not in keep],
            )

    async def run(self) -> None:
        """Register, then heartbeat every interval_seconds until cancelled (errors are retried)."""
        while True:
            try:
                await asyncio.wait_for(self.register(), timeout=30)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("node %s: registration failed (%s); retrying", self.spec.name, e)
                await asyncio.sleep(1)
        ok = True
        while True:  # after a failure, retry soon instead of a whole interval later
            await asyncio.sleep(self.interval if ok else min(1.0, self.interval))
            ok = False
            try:  # bounded: a hung request must not silence the node for minutes
                await asyncio.wait_for(self.heartbeat(), timeout=max(10.0, 3 * self.interval))
                ok = True
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning(
                    "node %s: heartbeat failed (%s: %s)", self.spec.name, type(e).__name__, e
                )
