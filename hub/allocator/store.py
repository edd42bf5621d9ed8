"""Persistence of allocations: an in-memory store and SQLite (JupyterHub-style database URLs).

Every change is one transaction (``commit(add, remove)``) written before the allocator's call
returns, so a crash leaves either the old or the new set of allocations, never a half of each.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from .model import GpuShare, Placement, Request


class AllocationStore(Protocol):
    """Where allocations survive restarts."""

    def load(self) -> list[Placement]:
        """Every persisted placement, oldest first."""
        ...

    def commit(self, add: Sequence[Placement], remove: Sequence[str]) -> None:
        """Atomically insert ``add`` and delete the ids in ``remove``."""
        ...

    def close(self) -> None:
        """Release resources."""
        ...


class MemoryStore:
    """Keeps allocations in memory only (tests, benchmarks, throw-away hubs)."""

    def __init__(self) -> None:
        self._rows: dict[str, Placement] = {}

    def load(self) -> list[Placement]:
        return sorted(self._rows.values(), key=lambda p: p.created_at)

    def commit(self, add: Sequence[Placement], remove: Sequence[str]) -> None:
        for rid in remove:
            self._rows.pop(rid, None)
        for p in add:
            self._rows[p.request.id] = p

    def close(self) -> None:
        pass


def request_to_dict(r: Request) -> dict[str, Any]:
    """JSON-ready fields; the soft placement preferences and the ledger's labels (profile,
    workload) only when set, so that rows and pod annotations of requests without one read as
    they did before they existed."""
    out: dict[str, Any] = {
        "id": r.id,
        "owner": r.owner,
        "groups": sorted(r.groups),
        "cpu_milli": r.cpu_milli,
        "memory_mib": r.memory_mib,
        "num_gpu": r.num_gpu,
        "gpu_milli": r.gpu_milli,
        "gpu_models": sorted(r.gpu_models),
        "priority": r.priority,
        "nvlink": r.nvlink,
        "affinity_group": r.affinity_group,
    }
    if r.preferred_node is not None:
        out["preferred_node"] = r.preferred_node
    if r.preferred_nvlink_group is not None:
        out["preferred_nvlink_group"] = r.preferred_nvlink_group
    for name in ("profile", "workload"):
        if getattr(r, name) is not None:
            out[name] = getattr(r, name)
    return out


def request_from_dict(d: dict[str, Any]) -> Request:
    return Request(
        id=d["id"],
        owner=d.get("owner", ""),
        groups=frozenset(d.get("groups", ())),
        cpu_milli=d.get("cpu_milli", 0),
        memory_mib=d.get("memory_mib", 0),
        num_gpu=d.get("num_gpu", 0),
        gpu_milli=d.get("gpu_milli", 0),
        gpu_models=frozenset(d.get("gpu_models", ())),
        priority=d.get("priority", "on-demand"),
        nvlink=d.get("nvlink", False),
        affinity_group=d.get("affinity_group"),
        preferred_node=d.get("preferred_node"),
        preferred_nvlink_group=d.get("preferred_nvlink_group"),
        profile=d.get("profile"),
        workload=d.get("workload"),
    )


def sqlite_path(url: str) -> str:
    """Path of a JupyterHub-style URL: ``sqlite:///rel.db``, ``sqlite:////abs.db``, ``sqlite://``."""
    if not url.startswith("sqlite://"):
        raise ValueError(f"Only sqlite:// database URLs are supported, got {url!r}")
    rest = url[len("sqlite://") :]
    if rest in ("", "/", "/:memory:"):
        return ":memory:"
    if not rest.startswith("/"):
        raise ValueError(
            f"Database URL {url!r}: expected sqlite:///relative.db or sqlite:////abs.db"
        )
    return rest[1:]


class SQLiteStore:
    """Allocations in one SQLite table: WAL journal, full sync, one transaction per change."""

    SCHEMA = """
    CREATE TABLE IF NOT EXISTS gpulab_allocations (
        id TEXT PRIMARY KEY,
        request TEXT NOT NULL,
        node TEXT NOT NULL,
        gpus TEXT NOT NULL,
        created_at REAL NOT NULL,
        over_quota INTEGER NOT NULL DEFAULT 0
    )
    """

    def __init__(self, url: str = "sqlite:///gpulab-allocations.sqlite") -> None:
        self.url = url
        self.path = sqlite_path(url)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(self.SCHEMA)

    def load(self) -> list[Placement]:
        with self._lock:
            rows = self._db.execute(
                "SELECT request, node, gpus, created_at, over_quota FROM gpulab_allocations "
                "ORDER BY created_at, id"
            ).fetchall()
        out = []
        for req, node, gpus, created, over in rows:
            shares = tuple(GpuShare(u, int(m)) for u, m in json.loads(gpus))
            out.append(
                Placement(
                    request_from_dict(json.loads(req)), node, shares, float(created), bool(over)
                )
            )
        return out

    def commit(self, add: Sequence[Placement], remove: Sequence[str]) -> None:
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                for rid in remove:
                    cur.execute("DELETE FROM gpulab_allocations WHERE id = ?", (rid,))
                for p in add:
                    cur.execute(
                        "INSERT INTO gpulab_allocations "
                        "(id, request, node, gpus, created_at, over_quota) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (
                            p.request.id,
                            json.dumps(request_to_dict(p.request), sort_keys=True),
                            p.node,
                            json.dumps([[s.uuid, s.milli] for s in p.gpus]),
                            p.created_at,
                            int(p.over_quota),
                        ),
                    )
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()
