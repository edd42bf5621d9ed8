"""Workspace operations run as the workspace's own account (pure: stdlib + checkpoint modules).

The hub is root, and a user's home and snapshot store are the user's: every path in them is hers
to replace with a symlink at any moment. A root process that walked, copied or renamed there would
be a confused deputy (a symlink swapped in mid-walk makes root copy /etc/shadow or the hub's cookie
secret into a snapshot the user then restores). So the hub never touches a user's files itself: it
runs this module as the user's account,

    python -I -m gpulab.spawner.singleuser.checkpoint.worker      (request JSON on stdin, answer on stdout)

and whatever a symlink points the worker at, it can read or write only what that user could
anyway. On a shared-account install (no account boundary) the hub calls `run_op` in a thread.

Answers are data about the user's own workspace and are used as such: the hub never acts as root
on a path or id it got back from here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gpulab.spawner.singleuser.checkpoint import snapshots as snaps
from gpulab.spawner.singleuser.checkpoint.signing import CheckpointRefused, read_key_file
from gpulab.spawner.singleuser.checkpoint.store import human_bytes, list_checkpoints


class WorkspaceOpError(Exception):
    """An operation refused for a reason the hub turns into a 4xx: `kind` is 'not-found' (no such
    snapshot) or 'exists' (the clone's target has a home already)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def listing(snap: snaps.Snapshot) -> dict[str, Any]:
    return {
        "id": snap.id,
        "label": snap.label,
        "created": snap.created,
        "files": snap.files,
        "bytes": snap.bytes,
        "size": human_bytes(snap.bytes),
    }


def _snapshot(home: str, store: str, label: str, keep_last: int, keep_daily: int) -> Any:
    if not Path(home).is_dir():
        return None
    snap = snaps.snapshot(Path(home), Path(store), label)
    snaps.apply_retention(Path(store), keep_last=keep_last, keep_daily=keep_daily)
    return listing(snap)


def _list(store: str) -> Any:
    return [listing(s) for s in reversed(snaps.list_snapshots(Path(store)))]


def _get(store: str, snapshot_id: str) -> snaps.Snapshot:
    try:
        return snaps.get_snapshot(Path(store), snapshot_id)
    except snaps.SnapshotError as e:
        raise WorkspaceOpError("not-found", str(e)) from None


def _restore(store: str, snapshot_id: str, home: str) -> Any:
    before = snaps.restore(_get(store, snapshot_id), Path(home))
    return {"before_restore": before.id if before else None}


def _clone(store: str, snapshot_id: str, new_home: str, rename: list[str]) -> Any:
    snap = _get(store, snapshot_id)
    target = Path(new_home)
    if target.exists() and any(target.iterdir()):
        raise WorkspaceOpError("exists", f"{target} is not empty")
    if target.exists():
        target.rmdir()
    old, new = rename
    snaps.clone(snap, target, rename_server=(old, new))
    return {}


def _offer(root: str, key_file: str, user: str) -> Any:
    try:
        key = read_key_file(Path(key_file))
    except CheckpointRefused:
        return []  # no key yet (never started): nothing signed to offer
    found = list_checkpoints(Path(root), key, user)
    return [
        {"notebook": slot, "offer": m.describe(), "variables": m.count, "bytes": m.data_bytes}
        for slot, m in found.items()
    ]


OPS = {
    "snapshot": _snapshot,
    "list": _list,
    "restore": _restore,
    "clone": _clone,
    "offer": _offer,
}


def run_op(op: str, args: dict[str, Any]) -> Any:
    """Run one operation in this process (as whoever this process is)."""
    try:
        fn = OPS[op]
    except KeyError:
        raise ValueError(f"unknown workspace operation {op!r}") from None
    return fn(**args)


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        result = run_op(request["op"], request.get("args", {}))
    except WorkspaceOpError as e:
        answer: dict[str, Any] = {"ok": False, "kind": e.kind, "message": str(e)}
    except Exception as e:  # reported to the hub, which logs it with the user's name
        answer = {"ok": False, "kind": "failed", "message": f"{type(e).__name__}: {e}"}
    else:
        answer = {"ok": True, "result": result}
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
