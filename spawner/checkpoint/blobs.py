"""One checkpoint blob on disk: a signed header plus raw segments, written atomically and read back
only after its HMAC checks out (pure: stdlib only).

Layout: b"GPULABCK", a little-endian u32 header length, the JSON header, zero padding to a 64-byte
boundary, then each segment padded to 64 bytes. For a value pickled with protocol 5, segment 0 is
the in-band pickle and the others are its out-of-band buffers (numpy/pandas/torch data, written
straight from the objects' memory: no pickle copy). The HMAC-SHA256 of the whole file is recorded
in the signed manifest; blobs are never rewritten in place, only created under new names.

Hashing and I/O overlap: each 8 MiB chunk is hashed on a helper thread while the main thread writes
(or reads) it, since both hashlib and file I/O release the GIL.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulab.spawner.checkpoint.signing import CheckpointRefused, new_mac, same

MAGIC = b"GPULABCK"
ALIGN = 64
CHUNK = 8 << 20
_MAX_HEADER = 1 << 20

_hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpulab-ckpt-hash")


def _submit(update: Any, chunk: memoryview) -> Future[None]:
    """Hash on the helper thread; inline once the interpreter is shutting down (atexit saves run
    after concurrent.futures stops accepting work)."""
    try:
        return _hasher.submit(update, chunk)
    except RuntimeError:
        update(chunk)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _pad(n: int) -> int:
    return (-n) % ALIGN


@dataclass(frozen=True)
class WrittenBlob:
    name: str
    size: int
    hmac: str


def _byte_view(obj: Any) -> memoryview:
    view = memoryview(obj)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_blob(
    directory: Path, name: str, header: dict[str, Any], segments: Sequence[Any], key: bytes
) -> WrittenBlob:
    """Write `segments` (bytes-like) under `directory/name` (0600): to `name.tmp`, fsync, rename.
    The caller fsyncs the directory once after its last blob."""
    seg_views = [_byte_view(s) for s in segments]
    head = dict(header, segments=[v.nbytes for v in seg_views])
    head_bytes = json.dumps(head, separators=(",", ":")).encode()
    prefix = MAGIC + struct.pack("<I", len(head_bytes)) + head_bytes
    prefix += b"\0" * _pad(len(prefix))
    mac = new_mac(key)
    tmp = directory / (name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pending: Future[None] | None = None
    size = 0
    try:
        pieces: list[memoryview] = [memoryview(prefix)]
        for v in seg_views:
            pieces.append(v)
            if _pad(v.nbytes):
                pieces.append(memoryview(b"\0" * _pad(v.nbytes)))
        for piece in pieces:
            for off in range(0, max(piece.nbytes, 1), CHUNK):
                chunk = piece[off : off + CHUNK]
                if not chunk:
                    continue
                if pending is not None:
                    pending.result()
                pending = _submit(mac.update, chunk)
                _write_all(fd, chunk)
                size += chunk.nbytes
        if pending is not None:
            pending.result()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    os.rename(tmp, directory / name)
    return WrittenBlob(name, size, mac.hexdigest())


def blob_hmac(header: dict[str, Any], segments: Sequence[Any], key: bytes) -> str:
    """The HMAC `write_blob` would record for this content, without writing it."""
    seg_views = [_byte_view(s) for s in segments]
    head = dict(header, segments=[v.nbytes for v in seg_views])
    head_bytes = json.dumps(head, separators=(",", ":")).encode()
    prefix = MAGIC + struct.pack("<I", len(head_bytes)) + head_bytes
    mac = new_mac(key)
    mac.update(prefix + b"\0" * _pad(len(prefix)))
    for v in seg_views:
        mac.update(v)
        mac.update(b"\0" * _pad(v.nbytes))
    return mac.hexdigest()


def read_blob(
    path: Path, key: bytes, expected_hmac: str, expected_size: int
) -> tuple[dict[str, Any], list[memoryview]]:
    """Read a blob into one aligned, writable buffer, verifying its HMAC as it streams in. Returns
    the header and memoryviews of the segments (backed by that buffer). Raises CheckpointRefused
    before anything is interpreted when the size or the signature is wrong."""
    import numpy as np  # aligned, writable buffers that restored arrays may keep as their base

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointRefused(f"{path.name}: missing (the manifest lists it)") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != expected_size:
            raise CheckpointRefused(
                f"{path.name}: {actual} bytes on disk, the signed manifest says {expected_size}"
            )
        buf = np.empty(actual, dtype=np.uint8)
        view = memoryview(buf)
        mac = new_mac(key)
        pending: Future[None] | None = None
        off = 0
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            while off < actual:
                chunk = view[off : off + CHUNK]
                got = 0
                while got < chunk.nbytes:
                    n = f.readinto(chunk[got:])
                    if not n:
                        raise CheckpointRefused(f"{path.name}: truncated while reading")
                    got += n
                if pending is not None:
                    pending.result()
                pending = _submit(mac.update, chunk)
                off += chunk.nbytes
        if pending is not None:
            pending.result()
    finally:
        os.close(fd)
    if not same(mac.hexdigest(), expected_hmac):
        raise CheckpointRefused(
            f"{path.name}: signature does not match this user's key (altered, or written for another user)"
        )
    if bytes(view[:8]) != MAGIC:
        raise CheckpointRefused(f"{path.name}: not a gpulab checkpoint blob")
    (hlen,) = struct.unpack("<I", view[8:12])
    if hlen > _MAX_HEADER or 12 + hlen > actual:
        raise CheckpointRefused(f"{path.name}: malformed header")
    header = json.loads(bytes(view[12 : 12 + hlen]))
    off = 12 + hlen
    off += _pad(off)
    segments = []
    for n in header.get("segments", []):
        if off + n > actual:
            raise CheckpointRefused(f"{path.name}: segment past the end of the file")
        segments.append(view[off : off + n])
        off += n + _pad(n)
    return header, segments


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
