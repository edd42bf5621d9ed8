"""A checkpoint store: signed manifests naming immutable blobs, replaced atomically (pure: stdlib,
plus numpy for read buffers).

Layout of one store (one kernel slot, e.g. one notebook), every directory 0700 and file 0600:

    <store>/manifest.json   the current checkpoint: a hex HMAC line, then the JSON body
    <store>/offered.json    the checkpoint found when this kernel started, offered for restore
    <store>/blobs/*.blob    one per saved variable version, never rewritten
    <store>/lock            flock held while a save commits

A save writes new blobs (fsync each, fsync the directory), then writes the manifest to a temporary
file, fsyncs it and renames it over manifest.json (then fsyncs the directory). A process killed at
any point leaves either the old or the new manifest, and every blob either names is complete; blobs
no manifest names are deleted by the next save.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpulab.spawner.singleuser.checkpoint.blobs import PendingBlob, fsync_dir
from gpulab.spawner.singleuser.checkpoint.signing import CheckpointRefused, same, sign

FORMAT = "gpulab-checkpoint/1"
CURRENT = "manifest.json"
OFFERED = "offered.json"


@dataclass
class Entry:
    """One saved variable: its blob, the blob's HMAC and size, and what it holds."""

    blob: str
    hmac: str
    size: int
    data_bytes: int
    type: str
    engine: str
    fingerprint: str = ""
    seconds: float = 0.0  # how long pickling it took (drives the per-cell cost budget)

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Entry:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


@dataclass
class Manifest:
    user: str
    slot: str
    saved_at: float
    kind: str  # "incremental" or "full"
    variables: dict[str, Entry] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # name -> name of the same object
    modules: dict[str, str] = field(default_factory=dict)  # name -> module to import
    unpicklable: dict[str, str] = field(default_factory=dict)  # name -> why it was not saved

    @property
    def data_bytes(self) -> int:
        return sum(e.data_bytes for e in self.variables.values())

    @property
    def count(self) -> int:
        return len(self.variables) + len(self.aliases) + len(self.modules)

    def body(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "user": self.user,
                "slot": self.slot,
                "saved_at": self.saved_at,
                "kind": self.kind,
                "variables": {k: v.to_json() for k, v in sorted(self.variables.items())},
                "aliases": self.aliases,
                "modules": self.modules,
                "unpicklable": self.unpicklable,
            },
            sort_keys=True,
        ).encode()

    def describe(self) -> str:
        """What a user is offered, e.g. 'Restore 23 variables (1.2 GB, saved 10:32)'."""
        n = self.count
        when = time.localtime(self.saved_at)
        today = time.localtime()
        stamp = time.strftime("%H:%M" if when[:3] == today[:3] else "%Y-%m-%d %H:%M", when)
        return f"Restore {n} variable{'s' if n != 1 else ''} ({human_bytes(self.data_bytes)}, saved {stamp})"


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


#: a manifest names each variable in a few hundred bytes; anything larger is not one
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of `path` when it is a regular file (not a link) of at most `limit` bytes;
    CheckpointRefused otherwise. A FIFO or a link to /dev/zero put in its place cannot make the
    reader (the hub's worker, a kernel) wait for ever or fill its memory. FileNotFoundError passes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointRefused(f"{path}: a symbolic link, not a checkpoint file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise CheckpointRefused(f"{path}: not a regular file of at most {limit} bytes")
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > limit:
                raise CheckpointRefused(f"{path}: grew past {limit} bytes while read")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class CheckpointStore:
    """The checkpoints of one kernel slot, signed with one user's key."""

    def __init__(self, path: Path, key: bytes, user: str, slot: str | None = None) -> None:
        self.path = Path(path)
        self.key = key
        self.user = user
        self.slot = slot or self.path.name
        self.blobs = self.path / "blobs"

    def ensure(self) -> None:
        _private_dir(self.path.parent)
        _private_dir(self.path)
        _private_dir(self.blobs)

    @contextlib.contextmanager
    def lock(self, timeout: float = 30.0) -> Iterator[None]:
        """Exclusive across processes (two kernels of one notebook); raises TimeoutError."""
        self.ensure()
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"checkpoint store {self.path} is locked by another kernel"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    # -- manifests -----------------------------------------------------------------------------

    def read_manifest(self, which: str = CURRENT) -> Manifest | None:
        """The verified manifest, None when there is none; CheckpointRefused when it is unsigned,
        signed with another key, altered, or another user's."""
        path = self.path / which
        try:
            raw = read_bounded(path, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None
        mac, sep, body = raw.partition(b"\n")
        if not sep or len(mac) != 64:
            raise CheckpointRefused(f"{path}: not signed by gpulab (no signature line)")
        if not same(sign(self.key, body), mac.decode("ascii", "replace")):
            raise CheckpointRefused(
                f"{path}: signature does not match the key of user {self.user!r} (altered, or written for another user); not loading it"
            )
        data = json.loads(body)
        if data.get("format") != FORMAT:
            raise CheckpointRefused(f"{path}: unknown format {data.get('format')!r}")
        if data.get("user") != self.user:
            raise CheckpointRefused(
                f"{path}: written for user {data.get('user')!r}, not {self.user!r}; not loading it"
            )
        return Manifest(
            user=data["user"],
            slot=data.get("slot", self.slot),
            saved_at=float(data["saved_at"]),
            kind=data.get("kind", "full"),
            variables={k: Entry.from_json(v) for k, v in data.get("variables", {}).items()},
            aliases=dict(data.get("aliases", {})),
            modules=dict(data.get("modules", {})),
            unpicklable=dict(data.get("unpicklable", {})),
        )

    def commit(self, manifest: Manifest, which: str = CURRENT) -> None:
        """Atomically make `manifest` the current (or offered) checkpoint, then drop blobs that no
        manifest names. The blobs it names must already be written and their directory fsynced."""
        self.ensure()
        body = manifest.body()
        _write_private(self.path / which, sign(self.key, body).encode() + b"\n" + body)
        fsync_dir(self.path)
        self.collect_garbage()

    def offer_previous(self) -> Manifest | None:
        """At kernel start: move the current checkpoint aside as the offered one (a fresh kernel
        must not overwrite state its user has not restored yet). Returns what is offered; raises
        CheckpointRefused, changing nothing, when a manifest does not verify."""
        with self.lock():
            current = self.read_manifest(CURRENT)  # CheckpointRefused: touch nothing
            if current is not None and current.count:
                os.replace(self.path / CURRENT, self.path / OFFERED)
                fsync_dir(self.path)
                return current
            offered = self.read_manifest(OFFERED)
            with contextlib.suppress(FileNotFoundError):
                (self.path / CURRENT).unlink()
            return offered

    def drop(self, which: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / which).unlink()
        self.collect_garbage()

    def collect_garbage(self) -> None:
        keep: set[str] = set()
        for which in (CURRENT, OFFERED):
            try:
                m = self.read_manifest(which)
            except (CheckpointRefused, ValueError):
                return  # a manifest we cannot verify: not ours to judge, leave every blob alone
            if m is not None:
                keep.update(e.blob for e in m.variables.values())
        if not self.blobs.is_dir():
            return
        for entry in os.scandir(self.blobs):
            if entry.name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    # -- reading -------------------------------------------------------------------------------

    def verified_blobs(
        self, manifest: Manifest
    ) -> dict[str, tuple[dict[str, Any], list[memoryview]]]:
        """Read and verify every blob of `manifest` before any is unpickled."""
        pending = {}
        for name, entry in manifest.variables.items():
            if "/" in entry.blob or entry.blob.startswith("."):
                raise CheckpointRefused(f"variable {name!r}: bad blob name {entry.blob!r}")
            # reading the next blob overlaps with hashing this one
            pending[name] = PendingBlob(self.blobs / entry.blob, self.key, entry.hmac, entry.size)
        return {name: p.verified() for name, p in pending.items()}


def describe(path: Path, key: bytes, user: str) -> str | None:
    """For the hub or a UI: what restoring the checkpoint in `path` would bring back (the offered
    one if a kernel moved it aside, else the current), or None. Verifies the manifest's signature,
    so a tampered checkpoint is never advertised."""
    store = CheckpointStore(Path(path), key, user)
    for which in (OFFERED, CURRENT):
        try:
            m = store.read_manifest(which)
        except CheckpointRefused:
            continue
        if m is not None and m.count:
            return m.describe()
    return None


def list_checkpoints(root: Path, key: bytes, user: str) -> dict[str, Manifest]:
    """Every slot under a server's checkpoint root whose manifest verifies for `user`."""
    out: dict[str, Manifest] = {}
    if not Path(root).is_dir():
        return out
    for slot in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        store = CheckpointStore(slot, key, user)
        for which in (CURRENT, OFFERED):
            try:
                m = store.read_manifest(which)
            except CheckpointRefused:
                continue
            if m is not None and m.count:
                out[slot.name] = m
                break
    return out
