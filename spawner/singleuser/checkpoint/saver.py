"""Saving a namespace into a checkpoint store and restoring it (no IPython imports: the kernel
extension in `kernel.py` is a thin adapter over `NamespaceCheckpointer`)."""

from __future__ import annotations

import secrets
import time
import types
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from gpulab.spawner.singleuser.checkpoint import namespace as ns_mod
from gpulab.spawner.singleuser.checkpoint.blobs import blob_hmac, fsync_dir, fsync_files, write_blob
from gpulab.spawner.singleuser.checkpoint.namespace import (
    Pickled,
    Tracker,
    Unpicklable,
    fingerprint,
    import_modules,
    pickle_value,
    quick_key,
    rebind_globals,
    unpickle_value,
    user_names,
)
from gpulab.spawner.singleuser.checkpoint.store import (
    CURRENT,
    OFFERED,
    CheckpointStore,
    Entry,
    Manifest,
    human_bytes,
)

DEFAULT_INCREMENTAL_MAX_BYTES = 256 * 1000 * 1000
DEFAULT_BUDGET_SECONDS = 0.05


@dataclass
class SaveReport:
    kind: str  # "incremental" (after a cell) or "full" (exact: shutdown, SIGTERM, on demand)
    committed: bool
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unpicklable: dict[str, str] = field(default_factory=dict)
    bytes_written: int = 0
    seconds: float = 0.0
    skipped: str = ""  # why nothing was committed

    def summary(self) -> str:
        if not self.committed:
            return f"checkpoint not saved: {self.skipped}"
        text = (
            f"checkpoint saved ({self.kind}): {len(self.written)} written "
            f"({human_bytes(self.bytes_written)}), {len(self.unchanged)} unchanged"
        )
        if self.unpicklable:
            text += "; not saved: " + ", ".join(
                f"{k} ({v})" for k, v in sorted(self.unpicklable.items())
            )
        return text


@dataclass
class RestoreReport:
    source: str
    description: str = ""
    restored: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(
        default_factory=dict
    )  # could not be rebuilt (e.g. missing package)
    not_saved: dict[str, str] = field(default_factory=dict)  # were unpicklable when saved
    device_fallbacks: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.restored and not self.failed:
            return "no checkpoint to restore"
        text = f"restored {len(self.restored)} variable{'s' if len(self.restored) != 1 else ''}"
        if self.restored:
            text += ": " + ", ".join(sorted(self.restored))
        if self.failed:
            text += "; failed: " + ", ".join(f"{k} ({v})" for k, v in sorted(self.failed.items()))
        if self.not_saved:
            text += "; not in the checkpoint (unpicklable): " + ", ".join(
                f"{k} ({v})" for k, v in sorted(self.not_saved.items())
            )
        for dev, to in self.device_fallbacks.items():
            text += f"; tensors saved on {dev} were restored to {to} ({dev} is not available)"
        return text


class NamespaceCheckpointer:
    """Incremental and exact saves of one namespace into one store, and restores from it."""

    def __init__(
        self,
        store: CheckpointStore,
        *,
        incremental_max_bytes: int = DEFAULT_INCREMENTAL_MAX_BYTES,
        budget_seconds: float = DEFAULT_BUDGET_SECONDS,
        lock_timeout: float = 30.0,
    ) -> None:
        self.store = store
        self.incremental_max_bytes = incremental_max_bytes
        self.budget_seconds = budget_seconds
        self.lock_timeout = lock_timeout
        self.trackers: dict[str, Tracker] = {}
        self.failed: dict[str, tuple[Tracker, str]] = {}  # unpicklable last time, and why
        self.committed: Manifest | None = None
        self.restored_names: set[str] = set()
        self.saving = False
        self.restoring = False

    def _new_manifest(self, kind: str) -> Manifest:
        return Manifest(self.store.user, self.store.slot, time.time(), kind)

    def _current(self) -> Manifest | None:
        if self.committed is not None:
            return self.committed
        try:
            return self.store.read_manifest(CURRENT)
        except Exception:
            return None  # unreadable: the next commit replaces it

    # -- saving --------------------------------------------------------------------------------

    def save(
        self, ns: Mapping[str, Any], hidden: Mapping[str, Any] | None = None, *, exact: bool = False
    ) -> SaveReport:
        """Save what changed since the last checkpoint. `exact` (shutdown, SIGTERM, on demand)
        compares full HMACs and ignores the size threshold; otherwise (after a cell) changes are
        found by fingerprint and a change larger than `incremental_max_bytes` is left for the next
        exact save."""
        start = time.perf_counter()
        kind = "full" if exact else "incremental"
        self.saving = True
        try:
            with self.store.lock(self.lock_timeout):
                report = self._save_locked(ns, hidden or {}, exact, kind)
        except TimeoutError as e:
            report = SaveReport(kind, False, skipped=str(e))
        finally:
            self.saving = False
        report.seconds = time.perf_counter() - start
        return report

    def _save_locked(
        self, ns: Mapping[str, Any], hidden: Mapping[str, Any], exact: bool, kind: str
    ) -> SaveReport:
        committed = self._current()
        old_vars = committed.variables if committed else {}
        new = self._new_manifest(kind)
        report = SaveReport(kind, False)
        to_write: list[tuple[str, Any, Pickled, str]] = []
        saved_ids: dict[int, str] = {}
        for name in user_names(ns, hidden, self.restored_names):
            obj = ns[name]
            if isinstance(obj, types.ModuleType):
                new.modules[name] = obj.__name__
                continue
            if id(obj) in saved_ids:
                new.aliases[name] = saved_ids[id(obj)]
                continue
            old = old_vars.get(name)
            tracker = self.trackers.get(name)
            if (
                old is not None
                and tracker is not None
                and not exact
                and tracker.unchanged_quickly(obj, self.budget_seconds)
            ):
                new.variables[name] = old
                saved_ids[id(obj)] = name
                continue
            failed = self.failed.get(name)
            if failed is not None and not exact and failed[0].same_object(obj):
                new.unpicklable[name] = failed[1]  # the same object failed before: do not retry
                continue
            try:
                p = pickle_value(obj)
            except Unpicklable as e:
                new.unpicklable[name] = str(e)
                self.failed[name] = (Tracker(obj, "", 0.0), str(e))
                continue
            self.failed.pop(name, None)
            saved_ids[id(obj)] = name
            fp = fingerprint(p)
            # an exact key (torch's version counter) that moved beats a sampled fingerprint
            moved = (
                tracker is not None
                and tracker.quick is not None
                and quick_key(obj) != tracker.quick
            )
            if (
                old is not None
                and not moved
                and old.fingerprint == fp
                and (not exact or blob_hmac(p.header(), p.segments(), self.store.key) == old.hmac)
            ):
                new.variables[name] = old
                self.trackers[name] = Tracker(obj, fp, p.seconds)
                continue
            to_write.append((name, obj, p, fp))
        report.unpicklable = dict(new.unpicklable)
        pending = sum(p.data_bytes for _, _, p, _ in to_write)
        if not exact and pending > self.incremental_max_bytes:
            report.skipped = (
                f"{human_bytes(pending)} changed, over the per-cell limit of "
                f"{human_bytes(self.incremental_max_bytes)}; saved at shutdown or with %gpulab_save"
            )
            return report
        if (
            not to_write
            and committed is not None
            and set(new.variables) == set(old_vars)
            and (new.aliases, new.modules, new.unpicklable)
            == (committed.aliases, committed.modules, committed.unpicklable)
        ):
            report.skipped = "nothing changed"
            report.unchanged = sorted(new.variables)
            return report
        written = []
        for name, obj, p, fp in to_write:
            blob = write_blob(
                self.store.blobs,
                f"{secrets.token_hex(8)}.blob",
                p.header(),
                p.segments(),
                self.store.key,
                fsync=False,
            )
            written.append(self.store.blobs / blob.name)
            new.variables[name] = Entry(
                blob=blob.name,
                hmac=blob.hmac,
                size=blob.size,
                data_bytes=p.data_bytes,
                type=p.type_name,
                engine=p.engine,
                fingerprint=fp,
                seconds=p.seconds,
            )
            self.trackers[name] = Tracker(obj, fp, p.seconds)
            report.written.append(name)
            report.bytes_written += blob.size
        if to_write:
            # one flush for all blobs (their writeback started while they were written), then
            # their names; only then may a manifest name them
            fsync_files(written)
            fsync_dir(self.store.blobs)
        self.store.commit(new)
        self.committed = new
        report.committed = True
        report.unchanged = sorted(set(new.variables) - set(report.written))
        report.removed = sorted(set(old_vars) - set(new.variables))
        for name in list(self.trackers):
            if name not in new.variables:
                del self.trackers[name]
        return report

    # -- restoring -----------------------------------------------------------------------------

    def available(self, prefer_current: bool = False) -> tuple[str, Manifest] | None:
        """The checkpoint a restore would use: the offered one (the last session's, which this
        kernel moved aside), else the current one. `prefer_current` reverses that: after a
        preemption the current one is the state of the kernel that was killed."""
        for which in (CURRENT, OFFERED) if prefer_current else (OFFERED, CURRENT):
            m = self.store.read_manifest(which)
            if m is not None and m.count:
                return which, m
        return None

    def restore(
        self,
        ns: MutableMapping[str, Any],
        which: str | None = None,
        *,
        prefer_current: bool = False,
    ) -> RestoreReport:
        """Verify every file of the checkpoint (CheckpointRefused, with nothing loaded, if any
        does not check out), rebuild the values and put them into `ns`. The restored state
        becomes the current checkpoint, so unchanged values are not written again."""
        self.restoring = True
        try:
            return self._restore(ns, which, prefer_current)
        finally:
            self.restoring = False

    def _restore(
        self, ns: MutableMapping[str, Any], which: str | None, prefer_current: bool
    ) -> RestoreReport:
        with self.store.lock(self.lock_timeout):
            found = (
                self.available(prefer_current)
                if which is None
                else (which, self.store.read_manifest(which))
            )
            if found is None or found[1] is None:
                return RestoreReport(source="")
            source, m = found
            report = RestoreReport(source=source, description=m.describe())
            blobs = self.store.verified_blobs(m)  # every signature checked before any unpickling
            ns_mod.DEVICE_FALLBACKS.clear()
            values: dict[str, Any] = {}
            for name, (header, segments) in blobs.items():
                try:
                    values[name] = unpickle_value(header, segments)
                except Exception as e:  # e.g. the class's package was uninstalled since
                    report.failed[name] = f"{type(e).__name__}: {e}"
            for alias, target in m.aliases.items():
                if target in values:
                    values[alias] = values[target]
            modules, errors = import_modules(m.modules)
            values.update(modules)
            report.failed.update(errors)
            for name, value in values.items():
                values[name] = rebind_globals(value, ns)
            ns.update(values)
            report.restored = sorted(values)
            report.not_saved = dict(m.unpicklable)
            report.device_fallbacks = dict(ns_mod.DEVICE_FALLBACKS)
            # adopt: the current checkpoint now holds what was restored (no rewrite of its blobs)
            base = self._current() if source != CURRENT else None
            merged = self._new_manifest(m.kind)
            if base is not None:
                merged.variables.update(base.variables)
                merged.aliases.update(base.aliases)
                merged.modules.update(base.modules)
            for name, entry in m.variables.items():
                if name in values:
                    merged.variables[name] = entry
                    self.trackers[name] = Tracker(values[name], entry.fingerprint, entry.seconds)
            merged.aliases.update({a: t for a, t in m.aliases.items() if t in merged.variables})
            merged.modules.update({k: v for k, v in m.modules.items() if k in values})
            merged.saved_at = m.saved_at
            self.store.commit(merged)
            if source == OFFERED:
                self.store.drop(OFFERED)
            self.committed = merged
            self.restored_names |= set(values)
        return report
