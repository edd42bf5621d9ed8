"""VolumeSnapshots of `gpulab-local` volumes: what external-snapshotter plus a CSI driver would do.

The `snapshot.storage.k8s.io/v1` API (CRDs VolumeSnapshotClass, VolumeSnapshot,
VolumeSnapshotContent, installed by the dev cluster at start) with driver ``gpulab.io/local``:

- a VolumeSnapshot of a Bound gpulab-local PVC (``spec.source.persistentVolumeClaimName``)
  becomes a hard-link snapshot tree of the volume's directory under
  ``STATE/snapshots/<pv>/<id>`` (`gpulab.spawner.singleuser.checkpoint.snapshots`: unchanged files are
  linked to the volume's previous snapshot, each snapshot is a complete tree), a
  VolumeSnapshotContent ``snapcontent-<snapshot uid>`` bound to it (``status.snapshotHandle`` =
  ``<pv>/<id>``), and the snapshot's ``status.readyToUse=true`` with ``restoreSize`` (bytes),
  ``creationTime`` and ``boundVolumeSnapshotContentName``; an empty
  ``spec.volumeSnapshotClassName`` is set to the default class of the driver, as the snapshot
  controller does;
- a snapshot of a pre-provisioned content (``spec.source.volumeSnapshotContentName``) is bound to
  it once the content exists;
- deleting a VolumeSnapshot deletes its content when the content's ``deletionPolicy`` is Delete;
  a deleted content's tree is removed (Retain keeps both).

Pre-existing snapshot trees are used by `volumes.Provisioner` for PVCs whose ``spec.dataSource``
names a VolumeSnapshot (`snapshot_tree`).
The CRDs and the default class are in `snapshotapi`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from gpulab.spawner.singleuser.checkpoint import snapshots as trees

from .kube import MERGE, Events, log, now, raw, status_of, watch_forever
from .podsecurity import copy_ownership
from .snapshotapi import (
    API_VERSION,
    DEFAULT_CLASS_ANNOTATION,
    DRIVER,
    FILES_ANNOTATION,
    GROUP,
    VERSION,
)

RETRY_SECONDS = 1.0
ORPHAN_GRACE_SECONDS = 300.0

# -- snapshot trees on disk ---------------------------------------------------------------------


def snapshot_tree(store_root: Path, handle: str) -> trees.Snapshot:
    """The snapshot tree of a content's snapshotHandle (`<pv>/<id>`); SnapshotError if absent."""
    pv, _, snap_id = handle.partition("/")
    if not pv or not snap_id or "/" in snap_id or pv in (".", ".."):
        raise trees.SnapshotError(f"malformed snapshotHandle {handle!r}")
    return trees.get_snapshot(store_root / pv, snap_id)


def _remove_tree(path: Path) -> None:
    """Remove a snapshot directory even where it recorded read-only directories."""

    def onerror(func: Any, p: str, exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
            func(p)

    if path.exists():
        shutil.rmtree(path, onerror=onerror)


def _rfc3339(epoch: float) -> str:
    # with microseconds: snapshots taken within one second still sort in order
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class SnapshotController:
    """Watches VolumeSnapshots and VolumeSnapshotContents and acts for driver gpulab.io/local."""

    def __init__(self, api: client.ApiClient, volumes_root: Path, store_root: Path) -> None:
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.events = Events(self.core)
        self.volumes_root, self.store_root = volumes_root, store_root
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def _lister(self, plural: str) -> Any:
        custom = self.custom

        def list_call(**kw: Any) -> Any:
            return custom.list_cluster_custom_object(GROUP, VERSION, plural, **kw)

        list_call.__doc__ = ":return: object"
        return list_call

    async def run(self) -> None:
        self.store_root.mkdir(parents=True, exist_ok=True)
        try:
            await asyncio.gather(
                watch_forever(
                    "volumesnapshots", self._lister("volumesnapshots"), self._on_snapshot
                ),
                watch_forever(
                    "volumesnapshotcontents",
                    self._lister("volumesnapshotcontents"),
                    self._on_content,
                    resync=self._resync_contents,
                ),
            )
        finally:
            for t in list(self._tasks):
                t.cancel()

    def _spawn(self, key: str, work: Any) -> None:
        """Run `work` (a coroutine) in the background, one at a time per object."""
        if key in self._busy:
            work.close()
            return
        self._busy.add(key)

        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("snapshots: %s: %s: %s", key, type(e).__name__, e)
            finally:
                self._busy.discard(key)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- API helpers ------------------------------------------------------------------------

    async def _get_snapshot(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return await raw(
                self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, ns, "volumesnapshots", name, _preload_content=False
                )
            )
        except Exception as e:
            if status_of(e) == 404:
                return None
            raise

    async def _get_content(self, name: str) -> dict[str, Any] | None:
        try:
            return await raw(
                self.custom.get_cluster_custom_object(
                    GROUP, VERSION, "volumesnapshotcontents", name, _preload_content=False
                )
            )
        except Exception as e:
            if status_of(e) == 404:
                return None
            raise

    async def _patch_snapshot(
        self, vs: dict[str, Any], body: dict[str, Any], *, status: bool
    ) -> None:
        meta = vs["metadata"]
        call = (
            self.custom.patch_namespaced_custom_object_status
            if status
            else self.custom.patch_namespaced_custom_object
        )
        await raw(
            call(
                GROUP,
                VERSION,
                meta["namespace"],
                "volumesnapshots",
                meta["name"],
                body,
                _content_type=MERGE,
                _preload_content=False,
            )
        )

    async def _class(self, name: str | None) -> dict[str, Any] | None:
        """The named VolumeSnapshotClass, or the default class of our driver when name is empty."""
        listing = await raw(
            self.custom.list_cluster_custom_object(
                GROUP, VERSION, "volumesnapshotclasses", _preload_content=False
            )
        )
        classes = listing.get("items", [])
        if name:
            return next((c for c in classes if c["metadata"]["name"] == name), None)
        defaults = [
            c
            for c in classes
            if c.get("driver") == DRIVER
            and (c["metadata"].get("annotations") or {}).get(DEFAULT_CLASS_ANNOTATION) == "true"
        ]
        return defaults[0] if len(defaults) == 1 else None

    async def _fail(self, vs: dict[str, Any], message: str) -> None:
        """Record why the snapshot is not ready yet (status.error and a Warning event, once)."""
        current = ((vs.get("status") or {}).get("error") or {}).get("message")
        if current == message:
            return
        with contextlib.suppress(Exception):
            await self._patch_snapshot(
                vs,
                {"status": {"readyToUse": False, "error": {"message": message, "time": now()}}},
                status=True,
            )
        await self.events.emit(
            vs,
            "SnapshotCreationFailed",
            message,
            type_="Warning",
            component="gpulab-snapshotter",
            kind="VolumeSnapshot",
        )

    # -- VolumeSnapshot -----------------------------------------------------------------------

    async def _on_snapshot(self, type_: str, vs: dict[str, Any]) -> None:
        meta = vs["metadata"]
        key = f"vs:{meta['namespace']}/{meta['name']}"
        if type_ == "DELETED":
            self._spawn(key + ":deleted", self._snapshot_deleted(vs))
            return
        if meta.get("deletionTimestamp") or (vs.get("status") or {}).get("readyToUse"):
            return
        self._spawn(key, self._reconcile_snapshot(vs))

    async def _reconcile_snapshot(self, vs: dict[str, Any]) -> None:
        """Make the snapshot ready, retrying while its PVC is not bound yet (until it is deleted)."""
        meta = vs["metadata"]
        while True:
            current = await self._get_snapshot(meta["namespace"], meta["name"])
            if current is None or current["metadata"].get("uid") != meta["uid"]:
                return
            if current["metadata"].get("deletionTimestamp") or (current.get("status") or {}).get(
                "readyToUse"
            ):
                return
            done = await self._try_snapshot(current)
            if done:
                return
            await asyncio.sleep(RETRY_SECONDS)

    async def _try_snapshot(self, vs: dict[str, Any]) -> bool:
        """One attempt; True when finished (ready, or not ours to handle)."""
        meta, spec = vs["metadata"], vs.get("spec") or {}
        source = spec.get("source") or {}
        class_name = spec.get("volumeSnapshotClassName")
        if source.get("volumeSnapshotContentName"):
            return await self._bind_precreated(vs, source["volumeSnapshotContentName"])
        snap_class = await self._class(class_name)
        if snap_class is None:
            if class_name:
                await self._fail(vs, f'VolumeSnapshotClass "{class_name}" not found')
                return False
            return True  # no default class of ours: another snapshotter's business
        if snap_class.get("driver") != DRIVER:
            return True
        if not class_name:  # as the snapshot controller does: record the default class used
            await self._patch_snapshot(
                vs,
                {"spec": {"volumeSnapshotClassName": snap_class["metadata"]["name"]}},
                status=False,
            )
        claim = source.get("persistentVolumeClaimName") or ""
        pv_dir, pv_name, message = await self._source_volume(meta["namespace"], claim)
        if pv_dir is None:
            await self._fail(vs, message)
            return False
        content_name = f"snapcontent-{meta['uid']}"
        content = await self._get_content(content_name)
        if content is None or not (content.get("status") or {}).get("snapshotHandle"):
            snap = await asyncio.to_thread(
                trees.snapshot, pv_dir, self.store_root / pv_name, meta["name"]
            )
            await asyncio.to_thread(copy_ownership, pv_dir, snap.tree)
            handle = f"{pv_name}/{snap.id}"
            if content is None:
                content = await self._create_content(
                    vs, content_name, snap_class, pv_name, snap.files
                )
            content = await self._set_content_status(content_name, snap, handle)
        handle = content["status"]["snapshotHandle"]
        snap = snapshot_tree(self.store_root, handle)
        await self._patch_snapshot(
            vs, {"metadata": {"annotations": {FILES_ANNOTATION: str(snap.files)}}}, status=False
        )
        await self._mark_snapshot_ready(vs, content_name, snap)
        log.info(
            "snapshot %s/%s of %s ready: %d files, %d bytes (%s)",
            meta["namespace"],
            meta["name"],
            claim,
            snap.files,
            snap.bytes,
            handle,
        )
        return True

    async def _source_volume(self, ns: str, claim: str) -> tuple[Path | None, str, str]:
        """(directory of the PVC's volume, PV name, why not) for a Bound gpulab-local claim."""
        try:
            pvc = await raw(
                self.core.read_namespaced_persistent_volume_claim(claim, ns, _preload_content=False)
            )
        except Exception as e:
            if status_of(e) == 404:
                return None, "", f'persistentvolumeclaim "{claim}" not found'
            raise
        pv_name = (pvc.get("spec") or {}).get("volumeName")
        if not pv_name or (pvc.get("status") or {}).get("phase") != "Bound":
            return None, "", f'persistentvolumeclaim "{claim}" is not bound yet'
        pv = await raw(self.core.read_persistent_volume(pv_name, _preload_content=False))
        path = Path(((pv.get("spec") or {}).get("hostPath") or {}).get("path") or "")
        if self.volumes_root not in path.parents:
            return None, "", f'persistentvolume "{pv_name}" is not a {DRIVER} volume'
        return path, pv_name, ""

    async def _create_content(
        self, vs: dict[str, Any], name: str, snap_class: dict[str, Any], pv_name: str, files: int
    ) -> dict[str, Any]:
        meta = vs["metadata"]
        body = {
            "apiVersion": API_VERSION,
            "kind": "VolumeSnapshotContent",
            "metadata": {"name": name, "annotations": {FILES_ANNOTATION: str(files)}},
            "spec": {
                "deletionPolicy": snap_class.get("deletionPolicy") or "Delete",
                "driver": DRIVER,
                "source": {"volumeHandle": pv_name},
                "volumeSnapshotClassName": snap_class["metadata"]["name"],
                "volumeSnapshotRef": {
                    "apiVersion": API_VERSION,
                    "kind": "VolumeSnapshot",
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                },
            },
        }
        try:
            return await raw(
                self.custom.create_cluster_custom_object(
                    GROUP, VERSION, "volumesnapshotcontents", body, _preload_content=False
                )
            )
        except Exception as e:
            if status_of(e) != 409:
                raise
        found = await self._get_content(name)
        assert found is not None
        return found

    async def _set_content_status(
        self, name: str, snap: trees.Snapshot, handle: str
    ) -> dict[str, Any]:
        body = {
            "status": {
                "creationTime": int(snap.created * 1e9),
                "readyToUse": True,
                "restoreSize": snap.bytes,
                "snapshotHandle": handle,
            }
        }
        return await raw(
            self.custom.patch_cluster_custom_object_status(
                GROUP,
                VERSION,
                "volumesnapshotcontents",
                name,
                body,
                _content_type=MERGE,
                _preload_content=False,
            )
        )

    async def _bind_precreated(self, vs: dict[str, Any], content_name: str) -> bool:
        content = await self._get_content(content_name)
        if content is None:
            await self._fail(vs, f'VolumeSnapshotContent "{content_name}" not found')
            return False
        if (content.get("spec") or {}).get("driver") != DRIVER:
            return True
        handle = ((content.get("spec") or {}).get("source") or {}).get("snapshotHandle") or (
            (content.get("status") or {}).get("snapshotHandle")
        )
        try:
            snap = snapshot_tree(self.store_root, handle or "")
        except trees.SnapshotError as e:
            await self._fail(vs, str(e))
            return False
        if not (content.get("status") or {}).get("readyToUse"):
            await self._set_content_status(content_name, snap, handle or "")
        await self._mark_snapshot_ready(vs, content_name, snap)
        return True

    async def _mark_snapshot_ready(
        self, vs: dict[str, Any], content_name: str, snap: trees.Snapshot
    ) -> None:
        """Bind the VolumeSnapshot to its content and report it ready, as the snapshotter does."""
        await self._patch_snapshot(
            vs,
            {
                "status": {
                    "boundVolumeSnapshotContentName": content_name,
                    "creationTime": _rfc3339(snap.created),
                    "readyToUse": True,
                    "restoreSize": str(snap.bytes),
                    "error": None,
                }
            },
            status=True,
        )

    async def _snapshot_deleted(self, vs: dict[str, Any]) -> None:
        """A deleted snapshot takes its content along when the content's policy is Delete."""
        name = (vs.get("status") or {}).get(
            "boundVolumeSnapshotContentName"
        ) or f"snapcontent-{vs['metadata']['uid']}"
        content = await self._get_content(name)
        if content is None or (content.get("spec") or {}).get("driver") != DRIVER:
            return
        ref = (content.get("spec") or {}).get("volumeSnapshotRef") or {}
        if ref.get("uid") and ref.get("uid") != vs["metadata"].get("uid"):
            return
        if (content.get("spec") or {}).get("deletionPolicy") != "Delete":
            return
        try:
            await raw(
                self.custom.delete_cluster_custom_object(
                    GROUP, VERSION, "volumesnapshotcontents", name, _preload_content=False
                )
            )
        except Exception as e:
            if status_of(e) != 404:
                raise

    # -- VolumeSnapshotContent ----------------------------------------------------------------

    async def _on_content(self, type_: str, content: dict[str, Any]) -> None:
        spec = content.get("spec") or {}
        if spec.get("driver") != DRIVER:
            return
        if type_ == "DELETED":
            if spec.get("deletionPolicy") == "Delete":
                handle = (content.get("status") or {}).get("snapshotHandle") or (
                    spec.get("source") or {}
                ).get("snapshotHandle")
                await asyncio.to_thread(self._remove_handle, handle or "")
            return
        if spec.get("deletionPolicy") == "Delete" and (content.get("status") or {}).get(
            "readyToUse"
        ):
            self._spawn(f"vsc:{content['metadata']['name']}", self._collect_orphan(content))

    def _remove_handle(self, handle: str) -> None:
        try:
            snap = snapshot_tree(self.store_root, handle)
        except trees.SnapshotError:
            return
        _remove_tree(snap.path)
        with contextlib.suppress(OSError):
            snap.store.rmdir()  # the volume's last snapshot: its store goes too
        log.info("removed snapshot data %s", handle)

    async def _collect_orphan(self, content: dict[str, Any]) -> None:
        """A Delete-policy content whose snapshot is gone (deleted while the agent was down)."""
        ref = (content.get("spec") or {}).get("volumeSnapshotRef") or {}
        if not ref.get("name") or not ref.get("namespace"):
            return
        vs = await self._get_snapshot(ref["namespace"], ref["name"])
        if vs is not None and (not ref.get("uid") or vs["metadata"].get("uid") == ref["uid"]):
            return
        with contextlib.suppress(Exception):
            await raw(
                self.custom.delete_cluster_custom_object(
                    GROUP,
                    VERSION,
                    "volumesnapshotcontents",
                    content["metadata"]["name"],
                    _preload_content=False,
                )
            )

    async def _resync_contents(self, items: list[dict[str, Any]]) -> None:
        """Trees on disk that no content names any more (its DELETED event was missed)."""
        handles = {
            (c.get("status") or {}).get("snapshotHandle")
            for c in items
            if (c.get("spec") or {}).get("driver") == DRIVER
        }

        def sweep() -> None:
            if not self.store_root.is_dir():
                return
            recent = time.time() - ORPHAN_GRACE_SECONDS  # trees whose content is being written
            for store in self.store_root.iterdir():
                for snap in trees.list_snapshots(store):
                    if f"{store.name}/{snap.id}" not in handles and snap.created < recent:
                        _remove_tree(snap.path)

        await asyncio.to_thread(sweep)
