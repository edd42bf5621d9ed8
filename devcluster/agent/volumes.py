"""The `gpulab-local` StorageClass and its provisioner: PVCs become directories on this machine.

An external provisioner in the Kubernetes sense: the PV controller (kube-controller-manager)
marks PVCs of class gpulab-local for provisioner ``gpulab.io/local``; this creates a hostPath PV
pre-bound to the claim under ``STATE/volumes/<pv>``, the PV controller binds the two, and when a
Released PV's reclaim policy is Delete the directory and the PV are deleted.

A claim whose ``spec.dataSource`` is a VolumeSnapshot (``apiGroup: snapshot.storage.k8s.io``) of
driver gpulab.io/local starts as a copy of that snapshot's tree (see `snapshots`); it stays
Pending, with a ``WaitingForSnapshot`` event, until the snapshot is ready to use.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from gpulab.spawner.singleuser.checkpoint import snapshots as trees

from . import snapshotapi, snapshots
from .kube import Events, log, raw, status_of, watch_forever
from .podsecurity import copy_ownership

STORAGE_CLASS = "gpulab-local"
PROVISIONER = "gpulab.io/local"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
STORAGE_PROVISIONER_ANNOTATIONS = (
    "volume.beta.kubernetes.io/storage-provisioner",
    "volume.kubernetes.io/storage-provisioner",
)


def storage_class() -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def _snapshot_source(spec: dict[str, Any]) -> str | None:
    """The VolumeSnapshot a claim's dataSource (or dataSourceRef) names, if any."""
    for key in ("dataSource", "dataSourceRef"):
        ref = spec.get(key) or {}
        if ref.get("kind") == "VolumeSnapshot" and ref.get("apiGroup") == snapshotapi.GROUP:
            return str(ref.get("name") or "")
    return None


class Provisioner:
    def __init__(
        self, api: client.ApiClient, root: Path, snapshot_root: Path | None = None
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.storage = client.StorageV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.events = Events(self.core)
        self.root = root
        self.snapshot_root = snapshot_root or root.parent / "snapshots"
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def ensure_storage_class(self) -> None:
        try:
            await raw(self.storage.create_storage_class(storage_class(), _preload_content=False))
        except Exception as e:
            if status_of(e) != 409:
                raise

    async def run(self) -> None:
        while True:
            try:
                await self.ensure_storage_class()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("creating StorageClass %s failed (%s); retrying", STORAGE_CLASS, e)
                await asyncio.sleep(1)
        self.root.mkdir(parents=True, exist_ok=True)
        await asyncio.gather(
            watch_forever(
                "persistentvolumeclaims",
                self.core.list_persistent_volume_claim_for_all_namespaces,
                self._on_pvc,
            ),
            watch_forever("persistentvolumes", self.core.list_persistent_volume, self._on_pv),
        )

    def _ours(self, pvc: dict[str, Any]) -> bool:
        spec, ann = pvc.get("spec") or {}, pvc["metadata"].get("annotations") or {}
        if spec.get("storageClassName") != STORAGE_CLASS:
            return False
        marked = [ann.get(a) for a in STORAGE_PROVISIONER_ANNOTATIONS if a in ann]
        return not marked or PROVISIONER in marked

    async def _on_pvc(self, type_: str, pvc: dict[str, Any]) -> None:
        meta, spec = pvc["metadata"], pvc.get("spec") or {}
        if type_ == "DELETED" or meta.get("deletionTimestamp") or spec.get("volumeName"):
            return
        if not self._ours(pvc) or meta["uid"] in self._busy:
            return
        self._busy.add(meta["uid"])
        if _snapshot_source(spec):
            # copying a snapshot takes a while and may wait for the snapshot: off the watch
            task = asyncio.create_task(self._provision_from_snapshot(pvc))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        try:
            await self._provision(pvc)
        finally:
            self._busy.discard(meta["uid"])

    async def _provision_from_snapshot(self, pvc: dict[str, Any]) -> None:
        meta = pvc["metadata"]
        source = _snapshot_source(pvc.get("spec") or {}) or ""
        waiting: str | None = None
        try:
            while True:
                current = await self._current_claim(pvc)
                if current is None or (current.get("spec") or {}).get("volumeName"):
                    return
                snap, why = await self._snapshot_for(meta["namespace"], source)
                if snap is not None:
                    await self._provision(current, snap)
                    return
                if why != waiting:
                    waiting = why
                    await self.events.emit(
                        current,
                        "WaitingForSnapshot",
                        why,
                        type_="Warning",
                        component=PROVISIONER,
                        kind="PersistentVolumeClaim",
                    )
                await asyncio.sleep(1)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("provisioning %s/%s from snapshot: %s", meta["namespace"], meta["name"], e)
        finally:
            self._busy.discard(meta["uid"])

    async def _current_claim(self, pvc: dict[str, Any]) -> dict[str, Any] | None:
        meta = pvc["metadata"]
        try:
            current = await raw(
                self.core.read_namespaced_persistent_volume_claim(
                    meta["name"], meta["namespace"], _preload_content=False
                )
            )
        except Exception as e:
            if status_of(e) == 404:
                return None
            raise
        if current["metadata"].get("uid") != meta["uid"] or current["metadata"].get(
            "deletionTimestamp"
        ):
            return None
        return current

    async def _snapshot_for(self, ns: str, name: str) -> tuple[trees.Snapshot | None, str]:
        """The tree of a ready gpulab-local VolumeSnapshot, or why there is none (yet)."""
        G, V = snapshotapi.GROUP, snapshotapi.VERSION
        try:
            vs = await raw(
                self.custom.get_namespaced_custom_object(
                    G, V, ns, "volumesnapshots", name, _preload_content=False
                )
            )
        except Exception as e:
            if status_of(e) == 404:
                return None, f'volumesnapshot "{name}" not found'
            raise
        status = vs.get("status") or {}
        content_name = status.get("boundVolumeSnapshotContentName")
        if not status.get("readyToUse") or not content_name:
            return None, f'volumesnapshot "{name}" is not ready to use yet'
        content = await raw(
            self.custom.get_cluster_custom_object(
                G, V, "volumesnapshotcontents", content_name, _preload_content=False
            )
        )
        handle = (content.get("status") or {}).get("snapshotHandle") or ""
        try:
            return snapshots.snapshot_tree(self.snapshot_root, handle), ""
        except trees.SnapshotError as e:
            return None, f'volumesnapshot "{name}": {e}'

    async def _provision(self, pvc: dict[str, Any], snap: trees.Snapshot | None = None) -> None:
        meta, spec = pvc["metadata"], pvc.get("spec") or {}
        pv_name = f"pvc-{meta['uid']}"
        path = self.root / pv_name
        if await self._pv_exists(pv_name):
            # a later event of the same claim (a controller updated it before binding it): its
            # folder is provisioned and a pod may already own it, through its fsGroup; making it
            # again would take the group's write bits back (a burst of spawns saw its homes'
            # preparation refused) or, for a snapshot, copy over a home in use
            return
        if snap is not None:
            if path.exists():
                shutil.rmtree(path)  # a copy an earlier attempt did not finish
            await asyncio.to_thread(trees.clone, snap, path)
            await asyncio.to_thread(copy_ownership, snap.tree, path)
        else:
            path.mkdir(parents=True, exist_ok=True)
        # the provisioner's own; pods write it through their fsGroup (podvolumes), as on a CSI
        # volume, and no other account of the machine reaches it (the volumes folder is 0700)
        path.chmod(0o755)
        size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name, "annotations": {PROVISIONED_BY: PROVISIONER}},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": STORAGE_CLASS,
                "volumeMode": spec.get("volumeMode") or "Filesystem",
                "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                "claimRef": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        try:
            await raw(self.core.create_persistent_volume(pv, _preload_content=False))
        except Exception as e:
            if status_of(e) == 409:
                return
            await self.events.emit(
                pvc,
                "ProvisioningFailed",
                f"failed to provision volume: {e}",
                type_="Warning",
                component=PROVISIONER,
                kind="PersistentVolumeClaim",
            )
            return
        origin = f" from snapshot {snap.id}" if snap is not None else ""
        await self.events.emit(
            pvc,
            "ProvisioningSucceeded",
            f"Successfully provisioned volume {pv_name} at {path}{origin}",
            component=PROVISIONER,
            kind="PersistentVolumeClaim",
        )

    async def _pv_exists(self, name: str) -> bool:
        try:
            await raw(self.core.read_persistent_volume(name, _preload_content=False))
        except Exception as e:
            if status_of(e) == 404:
                return False
            raise
        return True

    async def _on_pv(self, type_: str, pv: dict[str, Any]) -> None:
        meta, spec = pv["metadata"], pv.get("spec") or {}
        if (meta.get("annotations") or {}).get(PROVISIONED_BY) != PROVISIONER:
            return
        path = Path((spec.get("hostPath") or {}).get("path") or "")
        released = (pv.get("status") or {}).get("phase") in ("Released", "Failed")
        if (
            type_ == "DELETED"
            or not released
            or spec.get("persistentVolumeReclaimPolicy") != "Delete"
        ):
            return
        if self.root in path.parents:
            shutil.rmtree(path, ignore_errors=True)
        try:
            await raw(self.core.delete_persistent_volume(meta["name"], _preload_content=False))
            log.info("deleted released volume %s and %s", meta["name"], path)
        except Exception as e:
            if status_of(e) != 404:
                log.warning("deleting volume %s failed: %s", meta["name"], e)
