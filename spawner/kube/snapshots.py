"""VolumeSnapshots of workspace homes as the hub lists them, and their retention (pure: no client)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from gpulab.spawner.kube.quantities import parse_time, quantity_bytes
from gpulab.spawner.names import SNAPSHOT_FILES_ANNOTATION, SNAPSHOT_KIND_LABEL
from gpulab.spawner.singleuser.checkpoint.store import human_bytes


def snapshot_listing(vs: Mapping[str, Any]) -> dict[str, Any]:
    """A VolumeSnapshot as the hub lists workspace snapshots: id (its name), label (why it was
    taken), created (epoch seconds), files and bytes (None where the driver does not say), size,
    ready, pvc."""
    meta, status = vs.get("metadata") or {}, vs.get("status") or {}
    created = parse_time(status.get("creationTime")) or parse_time(meta.get("creationTimestamp"))
    files = (meta.get("annotations") or {}).get(SNAPSHOT_FILES_ANNOTATION)
    size = quantity_bytes(status.get("restoreSize"))
    return {
        "id": meta.get("name", ""),
        "label": (meta.get("labels") or {}).get(SNAPSHOT_KIND_LABEL, ""),
        "created": created or 0.0,
        "files": int(files) if files and str(files).isdigit() else None,
        "bytes": size,
        "size": human_bytes(size) if size is not None else "",
        "ready": bool(status.get("readyToUse")),
        "error": (status.get("error") or {}).get("message"),
        "pvc": ((vs.get("spec") or {}).get("source") or {}).get("persistentVolumeClaimName"),
    }


def snapshots_to_delete(
    listings: Iterable[Mapping[str, Any]],
    *,
    keep_last: int,
    keep_daily: int,
    now: float | None = None,
) -> list[str]:
    """Retention like the local backend's: keep the newest `keep_last` snapshots plus the newest
    of each of the last `keep_daily` UTC days (today included); the ids of the rest."""
    if keep_last < 0 or keep_daily < 0:
        raise ValueError(f"keep_last={keep_last} and keep_daily={keep_daily} must be >= 0")
    snaps = sorted(listings, key=lambda s: (float(s["created"]), str(s["id"])))
    keep = {str(s["id"]) for s in snaps[max(0, len(snaps) - keep_last) :]} if keep_last else set()
    today = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).date()
    newest_per_day: dict[Any, Mapping[str, Any]] = {}
    for s in snaps:
        newest_per_day[datetime.fromtimestamp(float(s["created"]), timezone.utc).date()] = s
    for day, s in newest_per_day.items():
        if 0 <= (today - day).days < keep_daily:
            keep.add(str(s["id"]))
    return [str(s["id"]) for s in snaps if str(s["id"]) not in keep]
