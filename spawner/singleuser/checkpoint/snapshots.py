"""Snapshots of a home volume on the local backend: incremental hard-link trees, restored or cloned
through a fresh directory that is swapped in whole (pure: stdlib).

A snapshot is `<store>/<id>/tree` (the home as it was) plus `<store>/<id>/snapshot.json`. A file
whose size, mtime and mode match the previous snapshot is hard-linked to it (rsync --link-dest),
every other file is copied (a reflink via FICLONE where the filesystem supports it: btrfs, XFS,
bcachefs; else copy_file_range/sendfile). So a snapshot of an unchanged home costs one directory
walk and one link per file, and stores nothing new; snapshots share unchanged files and each one
is still a complete tree that can be deleted independently (retention just removes directories).

Why not tar+zstd: a compressed archive rereads and recompresses the whole home on every snapshot
(time proportional to the home, not to what changed), restoring one file means decompressing the
stream, and it needs a zstd binding the standard library lacks before Python 3.14. Compression
would save space on the first snapshot only; with links, N snapshots of a mostly unchanged home
cost little more than one.

Snapshot files are never written after creation; restore and clone copy out of them (never link),
so editing a restored home cannot alter a snapshot. Each snapshot directory is 0700, the store
too: only the owner (and root) can list or read them. Snapshots taken while the server runs are
crash-consistent per file at best; the spawner snapshots on stop for a consistent one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from gpulab.spawner.singleuser.checkpoint.blobs import fsync_dir

_FICLONE = 0x40049409
_RENAME_EXCHANGE = 2
_META = "snapshot.json"
_TREE = "tree"


@dataclass(frozen=True)
class Snapshot:
    id: str
    path: Path  # the snapshot's directory; its files are under path / "tree"
    label: str
    created: float  # epoch seconds
    files: int
    bytes: int  # size of the home it captured
    new_bytes: int  # bytes it copied (not hard-linked to the previous snapshot)

    @property
    def tree(self) -> Path:
        return self.path / _TREE

    @property
    def store(self) -> Path:
        return self.path.parent

    @property
    def created_utc(self) -> datetime:
        return datetime.fromtimestamp(self.created, timezone.utc)


class SnapshotError(Exception):
    pass


# -- copying ------------------------------------------------------------------------------------


def _copy_file(src: str, dst: str, mode: int) -> bool:
    """Reflink when the filesystem can, else an in-kernel copy; the copy gets `mode` (0600 while
    it is written so that nobody else can open it meanwhile). False, and nothing copied, when
    `src` is no longer a regular file (replaced by a link or a FIFO since it was listed: the
    walk must neither follow the one nor wait on the other)."""
    try:
        src_fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOENT):
            return False
        raise
    if not stat.S_ISREG(os.fstat(src_fd).st_mode):
        os.close(src_fd)
        return False
    os.set_blocking(src_fd, True)
    with os.fdopen(src_fd, "rb") as fsrc:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fdst:
            try:
                fcntl.ioctl(fdst.fileno(), _FICLONE, fsrc.fileno())
            except OSError as e:
                if e.errno not in (
                    errno.EOPNOTSUPP,
                    errno.EXDEV,
                    errno.EINVAL,
                    errno.ENOTTY,
                    errno.EPERM,
                ):
                    raise
                _kernel_copy(fsrc, fdst)
    os.chmod(dst, stat.S_IMODE(mode))
    return True


def _kernel_copy(fsrc, fdst) -> None:  # type: ignore[no-untyped-def]
    size = os.fstat(fsrc.fileno()).st_size
    try:
        done = 0
        while done < size:
            n = os.copy_file_range(fsrc.fileno(), fdst.fileno(), min(size - done, 1 << 30))
            if n == 0:
                break
            done += n
        if done == size:
            return
    except OSError:
        pass
    fsrc.seek(0)
    fdst.seek(0)
    fdst.truncate()
    shutil.copyfileobj(fsrc, fdst, 8 << 20)


def _syncfs(path: Path) -> None:
    """Flush the filesystem holding `path` (one syscall instead of an fsync per file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            os.sync()
    except (OSError, AttributeError):
        os.sync()
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _walk(root: Path, excluded: set[str]) -> Iterable[tuple[str, os.DirEntry[str]]]:
    """(relative path, entry) for everything under root, parents before children."""
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel if rel else root) as it:
            for entry in sorted(it, key=lambda e: e.name):
                sub = f"{rel}/{entry.name}" if rel else entry.name
                if sub in excluded:
                    continue
                yield sub, entry
                if entry.is_dir(follow_symlinks=False):
                    stack.append(sub)


def _copy_tree(
    src: Path, dst: Path, link_from: Path | None, excluded: set[str]
) -> tuple[int, int, int]:
    """Copy src into the new directory dst; files unchanged against link_from are hard-linked.
    Returns (files, bytes, new_bytes)."""
    files = total = new = 0
    dirs: list[tuple[Path, os.stat_result]] = []
    for rel, entry in _walk(src, excluded):
        target = dst / rel
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            target.mkdir(mode=0o700)
            dirs.append((target, st))
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(entry.path), target)
        elif stat.S_ISREG(st.st_mode):
            files += 1
            total += st.st_size
            prev = link_from / rel if link_from is not None else None
            if prev is not None:
                try:
                    pst = os.lstat(prev)
                    if (
                        stat.S_ISREG(pst.st_mode)
                        and pst.st_size == st.st_size
                        and pst.st_mtime_ns == st.st_mtime_ns
                        and pst.st_mode == st.st_mode
                    ):
                        os.link(prev, target)
                        continue
                except FileNotFoundError:
                    pass
            if not _copy_file(entry.path, str(target), st.st_mode):
                files -= 1
                total -= st.st_size
                continue
            os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
            new += st.st_size
        # sockets, fifos, devices: not part of a workspace
    for d, st in reversed(dirs):  # children first, so setting a read-only mode cannot block them
        os.chmod(d, stat.S_IMODE(st.st_mode))
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
    return files, total, new


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")[:40] or "snapshot"


# -- API ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _store_lock(store: Path) -> Iterator[None]:
    """One writer per store at a time (the hub's scheduled, on-demand and on-stop snapshots of
    a server may overlap): without it, one call's stale-directory clean-up could remove the
    directory another is filling, or, racing its rename, empty the finished snapshot through the
    directory handle it already holds."""
    fd = os.open(store / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def snapshot(
    home: Path, store: Path, label: str = "manual", *, exclude: Iterable[str] = ()
) -> Snapshot:
    """Snapshot `home` into `store` (created 0700). Unchanged files are hard-linked against the
    newest snapshot. `exclude`: paths relative to home to leave out (caches). The snapshot appears
    only once complete and flushed: a crash leaves a hidden temporary directory, removed by the
    next call."""
    home, store = Path(home).resolve(), Path(store).resolve()
    if not home.is_dir():
        raise SnapshotError(f"home {home} is not a directory")
    if store == home or home in store.parents:
        raise SnapshotError(f"snapshot store {store} must not be inside the home {home}")
    _private_dir(store)
    with _store_lock(store):
        return _snapshot_locked(home, store, label, exclude)


def _snapshot_locked(home: Path, store: Path, label: str, exclude: Iterable[str]) -> Snapshot:
    for stale in store.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    created = time.time()
    stamp = datetime.fromtimestamp(created, timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    snap_id = f"{stamp}-{_slug(label)}-{secrets.token_hex(3)}"
    previous = list_snapshots(store)
    link_from = previous[-1].tree if previous else None
    tmp = store / f".tmp-{snap_id}"
    tmp.mkdir(mode=0o700)
    try:
        (tmp / _TREE).mkdir(mode=0o700)
        files, total, new = _copy_tree(home, tmp / _TREE, link_from, set(exclude))
        os.chmod(tmp / _TREE, stat.S_IMODE(os.stat(home).st_mode))
        meta = {
            "id": snap_id,
            "label": label,
            "created": created,
            "files": files,
            "bytes": total,
            "new_bytes": new,
        }
        (tmp / _META).write_text(json.dumps(meta))
        _syncfs(tmp)
        os.rename(tmp, store / snap_id)
        fsync_dir(store)
    except BaseException:
        _rmtree(tmp)
        raise
    return Snapshot(snap_id, store / snap_id, label, created, files, total, new)


def _rmtree(path: Path) -> None:
    """Remove a tree even where a snapshot recorded read-only directories."""

    def onerror(func, p, exc):  # type: ignore[no-untyped-def]
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onerror=onerror)


def list_snapshots(store: Path) -> list[Snapshot]:
    """Complete snapshots in `store`, oldest first."""
    store = Path(store)
    out: list[Snapshot] = []
    if not store.is_dir():
        return out
    for d in store.iterdir():
        if d.name.startswith(".") or not (d / _META).is_file():
            continue
        try:
            m = json.loads((d / _META).read_text())
            out.append(
                Snapshot(
                    m["id"],
                    d,
                    m["label"],
                    float(m["created"]),
                    m["files"],
                    m["bytes"],
                    m["new_bytes"],
                )
            )
        except (ValueError, KeyError):
            continue
    return sorted(out, key=lambda s: (s.created, s.id))


def get_snapshot(store: Path, snapshot_id: str) -> Snapshot:
    for s in list_snapshots(store):
        if s.id == snapshot_id:
            return s
    raise SnapshotError(f"no snapshot {snapshot_id!r} in {store}")


def _materialize(snap: Snapshot, parent: Path, name: str) -> Path:
    """A full, independent copy of the snapshot's tree as parent/.name (same filesystem as the
    destination, so it can be renamed into place)."""
    if not snap.tree.is_dir():
        raise SnapshotError(f"snapshot {snap.id} has no tree at {snap.tree}")
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / f".{name}.restore-{secrets.token_hex(4)}"
    staging.mkdir(mode=0o700)
    try:
        _copy_tree(snap.tree, staging, None, set())
        os.chmod(staging, stat.S_IMODE(os.stat(snap.tree).st_mode))
        _syncfs(staging)
    except BaseException:
        _rmtree(staging)
        raise
    return staging


def restore(snap: Snapshot, home: Path, *, keep_current: bool = True) -> Snapshot | None:
    """Make `home` exactly the snapshot's tree. The tree is copied into a fresh sibling directory
    first and swapped in with one atomic exchange (renameat2), so `home` is never half-restored.
    With `keep_current`, the home as it was is snapshotted first (label 'before-restore') and
    returned, so a restore can itself be undone. The server must be stopped."""
    home = Path(home).absolute()
    before = (
        snapshot(home, snap.store, "before-restore") if keep_current and home.is_dir() else None
    )
    staging = _materialize(snap, home.parent, home.name)
    if home.exists():
        if _exchange(staging, home):
            fsync_dir(home.parent)
            _rmtree(staging)  # now the old home
            return before
        old = home.parent / f".{home.name}.old-{secrets.token_hex(4)}"
        os.rename(home, old)
        os.rename(staging, home)
        fsync_dir(home.parent)
        _rmtree(old)
    else:
        os.rename(staging, home)
        fsync_dir(home.parent)
    return before


def clone(snap: Snapshot, new_home: Path, *, rename_server: tuple[str, str] | None = None) -> Path:
    """A new home (e.g. for a new named server) with the snapshot's content; `new_home` must not
    exist. Appears whole or not at all. `rename_server=(old, new)` moves the kernel checkpoints
    of server `old` (`.gpulab/checkpoints/<old>`) to where server `new` looks for them."""
    new_home = Path(new_home).absolute()
    if new_home.exists():
        raise SnapshotError(f"{new_home} already exists; clone into a new path")
    staging = _materialize(snap, new_home.parent, new_home.name)
    if rename_server is not None:
        root = staging / ".gpulab" / "checkpoints"
        old, new = (root / (name or "default") for name in rename_server)
        if old.is_dir() and old != new:
            _rmtree(new)
            os.rename(old, new)
    os.rename(staging, new_home)
    fsync_dir(new_home.parent)
    return new_home


def apply_retention(
    store: Path, *, keep_last: int = 5, keep_daily: int = 7, now: float | None = None
) -> list[Snapshot]:
    """Keep the newest `keep_last` snapshots plus, for each UTC day of the last `keep_daily`
    days (today included), the newest snapshot of that day; delete the rest. Returns what was
    deleted."""
    if keep_last < 0 or keep_daily < 0:
        raise ValueError(f"keep_last={keep_last} and keep_daily={keep_daily} must be >= 0")
    if not Path(store).is_dir():
        return []
    with _store_lock(Path(store)):
        return _apply_retention_locked(Path(store), keep_last, keep_daily, now)


def _apply_retention_locked(
    store: Path, keep_last: int, keep_daily: int, now: float | None
) -> list[Snapshot]:
    snaps = list_snapshots(store)
    keep = {s.id for s in snaps[max(0, len(snaps) - keep_last) :]} if keep_last else set()
    today = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).date()
    newest_per_day: dict[object, Snapshot] = {}
    for s in snaps:
        newest_per_day[s.created_utc.date()] = s  # ascending: the last one per day wins
    for day, s in newest_per_day.items():
        if 0 <= (today - day).days < keep_daily:  # type: ignore[operator]
            keep.add(s.id)
    deleted = [s for s in snaps if s.id not in keep]
    for s in deleted:
        _rmtree(s.path)
    return deleted
