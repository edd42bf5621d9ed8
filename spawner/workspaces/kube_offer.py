"""The picker's kernel-checkpoint offer read from a user's volume by the hub, safely.

On the dev cluster (and any hostPath-backed volume) the hub reads a user's kernel checkpoints in
her volume itself, as root. Every name below the volume's root is hers to replace at any moment:
a symlink would have root read what she cannot, a FIFO would hold the reading thread for ever (one
of the hub's few pool threads per request), a link to /dev/zero would fill the hub's memory. So
the manifests are opened relative to directory descriptors, never following a link, only when
they are regular files of a bounded size, and copied into a private folder where the checkpoint
store verifies them (their signatures: only what her own kernels wrote is offered).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from gpulab.spawner.singleuser.checkpoint.store import (
    CURRENT,
    MAX_MANIFEST_BYTES,
    OFFERED,
    Manifest,
    list_checkpoints,
)

_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: opening a FIFO returns at once (and fstat then says it is no regular file)
_NOFOLLOW_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@contextlib.contextmanager
def _fd(path: str, flags: int, dir_fd: int | None = None) -> Iterator[int]:
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _read_regular(name: str, dir_fd: int) -> bytes | None:
    """The file `name` in `dir_fd` when it is a regular file (not a link) of at most
    MAX_MANIFEST_BYTES; None otherwise."""
    try:
        with _fd(name, _NOFOLLOW_FILE, dir_fd) as fd:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                return None
            data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    except OSError:  # missing, a link (ELOOP), unreadable
        return None
    return data if len(data) <= MAX_MANIFEST_BYTES else None


def copy_manifests(volume: Path, parts: Sequence[str], into: Path) -> int:
    """Copy the manifests of every slot under `volume`/`parts` (the user's names) into `into`
    (one folder per slot); return how many were copied. `volume` itself must be trusted (the PV's
    folder, made by the provisioner)."""
    copied = 0
    try:
        with contextlib.ExitStack() as stack:
            fd = stack.enter_context(_fd(str(volume), _NOFOLLOW_DIR))
            for part in parts:
                fd = stack.enter_context(_fd(part, _NOFOLLOW_DIR, fd))
            root_fd = fd
            entries = stack.enter_context(os.scandir(root_fd))
            for entry in entries:
                try:
                    with _fd(entry.name, _NOFOLLOW_DIR, root_fd) as slot_fd:
                        for name in (CURRENT, OFFERED):
                            data = _read_regular(name, slot_fd)
                            if data is None:
                                continue
                            (into / entry.name).mkdir(exist_ok=True)
                            (into / entry.name / name).write_bytes(data)
                            copied += 1
                except OSError:  # not a folder, or a link to one
                    continue
    except OSError:  # no checkpoints yet, or a link where a folder should be
        return copied
    return copied


def offered_checkpoints(
    volume: Path, parts: Sequence[str], key: bytes, user: str
) -> dict[str, Manifest]:
    """Every slot whose manifest verifies for `user`, read as copy_manifests reads them (blocking:
    call it in a thread)."""
    # 0700 and root's: the pods (uid 1000, on this same file system) cannot enter it
    with tempfile.TemporaryDirectory(prefix="gpulab-offer-") as tmp:
        if not copy_manifests(volume, parts, Path(tmp)):
            return {}
        return list_checkpoints(Path(tmp), key, user)
