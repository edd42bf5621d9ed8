"""The Kubernetes calls behind workspaces: PVCs and VolumeSnapshots of one namespace.

Kept apart from `workspaces.kube` (what a workspace is: which PVC, which labels, when to
snapshot) so that each reads on its own; all calls go through the spawner's own API client, with
the hub's service account, never through anything a user's pod can reach.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kubernetes_asyncio.client import CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException
from tornado import web

from gpulab.spawner.kube.objects import SNAPSHOT_GROUP, SNAPSHOT_VERSION

SNAPSHOTS = "volumesnapshots"


class WorkspaceTimeout(web.HTTPError):
    """A snapshot or a restored PVC was not ready in time (503: try again)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message)


class NoSnapshotAPI(Exception):
    """The cluster has no snapshot.storage.k8s.io/v1 API (the external-snapshotter CRDs)."""


class WorkspaceVolumes:
    """PVCs and VolumeSnapshots in `namespace`; waits give up after `timeout_seconds`."""

    def __init__(self, api: CoreV1Api, namespace: str, timeout_seconds: float) -> None:
        self.api = api
        self.custom = CustomObjectsApi(api.api_client)
        self.namespace = namespace
        self.timeout_seconds = timeout_seconds

    def _plain(self, obj: Any) -> dict[str, Any]:
        plain: dict[str, Any] = self.api.api_client.sanitize_for_serialization(obj)
        return plain

    # -- PVCs and PVs ---------------------------------------------------------------------------

    async def pvc(self, name: str) -> dict[str, Any] | None:
        try:
            pvc = await self.api.read_namespaced_persistent_volume_claim(name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return self._plain(pvc)

    async def host_path_of(self, pvc_name: str) -> str | None:
        """The folder of the claim's PV when it is a hostPath (None otherwise, or unreadable)."""
        try:
            pvc = await self.pvc(pvc_name)
            pv_name = ((pvc or {}).get("spec") or {}).get("volumeName")
            if not pv_name:
                return None
            pv = self._plain(await self.api.read_persistent_volume(pv_name))
        except ApiException:
            return None
        path = ((pv.get("spec") or {}).get("hostPath") or {}).get("path")
        return str(path) if path else None

    async def create_bound_pvc(self, body: dict[str, Any], what: str) -> None:
        """Create the PVC and wait until it is bound (its data copied from its dataSource);
        FileExistsError when one of that name exists; on timeout it is deleted again."""
        name = body["metadata"]["name"]
        try:
            await self.api.create_namespaced_persistent_volume_claim(self.namespace, body)
        except ApiException as e:
            if e.status == 409:
                raise FileExistsError(f"PVC {self.namespace}/{name} already exists") from None
            raise
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            pvc = await self.pvc(name)
            if pvc and (pvc.get("status") or {}).get("phase") == "Bound":
                return
            if time.monotonic() > deadline:
                await self.delete_pvc(name)
                raise WorkspaceTimeout(
                    f"{what} was not ready after {self.timeout_seconds:.0f} s; try again"
                )
            await asyncio.sleep(0.3)

    async def delete_pvc(self, name: str) -> None:
        try:
            await self.api.delete_namespaced_persistent_volume_claim(name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise

    # -- VolumeSnapshots ------------------------------------------------------------------------

    async def snapshots(self, label_selector: str) -> list[dict[str, Any]]:
        """VolumeSnapshots matching the selector; NoSnapshotAPI when the cluster has none."""
        try:
            listing = await self.custom.list_namespaced_custom_object(
                SNAPSHOT_GROUP,
                SNAPSHOT_VERSION,
                self.namespace,
                SNAPSHOTS,
                label_selector=label_selector,
            )
        except ApiException as e:
            if e.status == 404:
                raise NoSnapshotAPI from None
            raise
        return list(listing.get("items", []))

    async def snapshot(self, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
                SNAPSHOT_GROUP, SNAPSHOT_VERSION, self.namespace, SNAPSHOTS, name
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return found

    async def create_snapshot(self, body: dict[str, Any]) -> None:
        """Create a VolumeSnapshot; NoSnapshotAPI when the cluster has none."""
        try:
            await self.custom.create_namespaced_custom_object(
                SNAPSHOT_GROUP, SNAPSHOT_VERSION, self.namespace, SNAPSHOTS, body
            )
        except ApiException as e:
            if e.status == 404:
                raise NoSnapshotAPI from None
            raise

    async def wait_snapshot_ready(self, name: str, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            vs = await self.snapshot(name)
            status = (vs or {}).get("status") or {}
            if vs is not None and status.get("readyToUse"):
                return vs
            if time.monotonic() > deadline:
                why = (status.get("error") or {}).get("message") or "no snapshotter answered"
                raise WorkspaceTimeout(
                    f"Snapshot {name} of {what} is not ready after "
                    f"{self.timeout_seconds:.0f} s: {why}"
                )
            await asyncio.sleep(0.3)

    async def delete_snapshot(self, name: str) -> None:
        try:
            await self.custom.delete_namespaced_custom_object(
                SNAPSHOT_GROUP, SNAPSHOT_VERSION, self.namespace, SNAPSHOTS, name
            )
        except ApiException as e:
            if e.status != 404:
                raise
