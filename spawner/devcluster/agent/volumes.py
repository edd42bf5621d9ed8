"""The `gpulab-local` StorageClass and its provisioner: PVCs become directories on this machine.

An external provisioner in the Kubernetes sense: the PV controller (kube-controller-manager)
marks PVCs of class gpulab-local for provisioner ``gpulab.io/local``; this creates a hostPath PV
pre-bound to the claim under ``STATE/volumes/<pv>``, the PV controller binds the two, and when a
Released PV's reclaim policy is Delete the directory and the PV are deleted.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from .kube import Events, log, raw, status_of, watch_forever

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


class Provisioner:
    def __init__(self, api: client.ApiClient, root: Path) -> None:
        self.core = client.CoreV1Api(api)
        self.storage = client.StorageV1Api(api)
        self.events = Events(self.core)
        self.root = root
        self._busy: set[str] = set()

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
        try:
            await self._provision(pvc)
        finally:
            self._busy.discard(meta["uid"])

    async def _provision(self, pvc: dict[str, Any]) -> None:
        meta, spec = pvc["metadata"], pvc.get("spec") or {}
        pv_name = f"pvc-{meta['uid']}"
        path = self.root / pv_name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)
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
        await self.events.emit(
            pvc,
            "ProvisioningSucceeded",
            f"Successfully provisioned volume {pv_name} at {path}",
            component=PROVISIONER,
            kind="PersistentVolumeClaim",
        )

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
