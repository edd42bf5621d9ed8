"""One checkpoint blob on disk: a signed header plus raw segments, written atomically and read back
only after its HMAC checks out (pure: stdlib only).

Layout: b"GPULABCK", a little-endian u32 header length, the JSON header, zero padding to a 64-byte
boundary, then each segment padded to 64 bytes. For a value pickled with protocol 5, segment 0 is
the in-band pickle and the others are its out-of-band buffers (numpy/pandas/torch data, written
straight from the objects' memory: no pickle copy). The HMAC-SHA256 of the whole file is recorded
in the signed manifest; blobs are never rewritten in place, only created under new names.

Hashing and I/O overlap: each 1 MiB chunk is hashed on a helper thread while the main thread writes
(or reads) it, since both hashlib and file I/O release the GIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulab.spawner.singleuser.checkpoint.signing import CheckpointRefused, new_mac, same

MAGIC = b"GPULABCK"
ALIGN = 64
CHUNK = 1 << 20
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


def _start_writeback_fn() -> Any:
    """sync_file_range(SYNC_FILE_RANGE_WRITE) through libc: start writing a range to disk now,
    without waiting, so that the disk works while the CPU hashes and copies the next chunks and
    the final fsync has little left to do. None where unavailable (then fsync does it all)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_start_writeback = _start_writeback_fn()
_SYNC_FILE_RANGE_WRITE = 2
WRITEBACK_CHUNK = 8 << 20


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
    directory: Path,
    name: str,
    header: dict[str, Any],
    segments: Sequence[Any],
    key: bytes,
    *,
    fsync: bool = True,
) -> WrittenBlob:
    """Write `segments` (bytes-like) under `directory/name` (0600): to `name.tmp`, fsync, rename.
    The caller fsyncs the directory once after its last blob. With fsync=False the caller must
    `fsync_files` the blobs before a manifest names them (one flush for many blobs)."""
    seg_views = [_byte_view(s) for s in segments]
    head = dict(header, segments=[v.nbytes for v in seg_views])
    head_bytes = json.dumps(head, separators=(",", ":")).encode()
    prefix = MAGIC + struct.pack("<I", len(head_bytes)) + head_bytes
    prefix += b"\0" * _pad(len(prefix))
    mac = new_mac(key)
    tmp = directory / (name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    size = 0
    try:
        pieces: list[memoryview] = [memoryview(prefix)]
        for v in seg_views:
            pieces.append(v)
            if _pad(v.nbytes):
                pieces.append(memoryview(b"\0" * _pad(v.nbytes)))
        # the helper thread hashes the pieces in order while this thread writes them
        hashed = [_submit(mac.update, piece) for piece in pieces if piece.nbytes]
        flushed = 0
        for piece in pieces:
            for off in range(0, piece.nbytes, CHUNK):
                chunk = piece[off : off + CHUNK]
                _write_all(fd, chunk)
                size += chunk.nbytes
                if _start_writeback is not None and size - flushed >= WRITEBACK_CHUNK:
                    _start_writeback(fd, flushed, size - flushed, _SYNC_FILE_RANGE_WRITE)
                    flushed = size
        if fsync:
            os.fsync(fd)
        for f in hashed:
            f.result()
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
    return str(mac.hexdigest())


class PendingBlob:
    """A blob read into memory whose HMAC is still being computed on the helper thread. Reading
    the next blob overlaps with hashing this one; `verified()` waits, checks, then parses."""

    def __init__(self, path: Path, key: bytes, expected_hmac: str, expected_size: int) -> None:
        import numpy as np  # aligned, writable buffers that restored arrays keep as their base

        self.path = path
        self.expected_hmac = expected_hmac
        self.mac = new_mac(key)
        self.hashed: list[Future[None]] = []
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointRefused(f"{path.name}: missing (the manifest lists it)") from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != expected_size:
                raise CheckpointRefused(
                    f"{path.name}: {actual} bytes on disk, the signed manifest says {expected_size}"
                )
            self.buf = np.empty(actual, dtype=np.uint8)
            view = memoryview(self.buf)  # type: ignore[arg-type]
            step = max(1 << 20, min(16 << 20, actual // 8))
            off = 0
            while off < actual:
                chunk = view[off : off + step]
                got = 0
                while got < chunk.nbytes:
                    n = f.readinto(chunk[got:])
                    if not n:
                        raise CheckpointRefused(f"{path.name}: truncated while reading")
                    got += n
                self.hashed.append(_submit(self.mac.update, chunk))
                off += chunk.nbytes

    def verified(self) -> tuple[dict[str, Any], list[memoryview]]:
        """The header and segment views (backed by one buffer); CheckpointRefused before anything
        is interpreted when the signature is wrong."""
        for f in self.hashed:
            f.result()
        name = self.path.name
        if not same(self.mac.hexdigest(), self.expected_hmac):
            raise CheckpointRefused(
                f"{name}: signature does not match this user's key (altered, or written for another user)"
            )
        view = memoryview(self.buf)  # type: ignore[arg-type]
        actual = view.nbytes
        if bytes(view[:8]) != MAGIC:
            raise CheckpointRefused(f"{name}: not a gpulab checkpoint blob")
        (hlen,) = struct.unpack("<I", view[8:12])
        if hlen > _MAX_HEADER or 12 + hlen > actual:
            raise CheckpointRefused(f"{name}: malformed header")
        header = json.loads(bytes(view[12 : 12 + hlen]))
        off = 12 + hlen
        off += _pad(off)
        segments = []
        for n in header.get("segments", []):
            if off + n > actual:
                raise CheckpointRefused(f"{name}: segment past the end of the file")
            segments.append(view[off : off + n])
            off += n + _pad(n)
        return header, segments


def read_blob(
    path: Path, key: bytes, expected_hmac: str, expected_size: int
) -> tuple[dict[str, Any], list[memoryview]]:
    """Read and verify one blob (see PendingBlob)."""
    return PendingBlob(path, key, expected_hmac, expected_size).verified()


def fsync_files(paths: Sequence[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
