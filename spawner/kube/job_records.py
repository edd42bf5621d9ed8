"""A started attempt's record in the hub: `KubeHandle` (the plain values the job service
stores) and the attempt's files in the hub's runs folder (`log`, `log.partial`, `ended-by`,
`result.json`; see `jobs.py`'s docstring), written atomically and read without following links.

Apart from the executor in `jobs.py` as the part that touches the hub's disk, not the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gpulab.spawner.kube.job_outcomes import KubeOutcome

#: the most of a pod's log the hub keeps (the kubelet rotates container logs near this too)
MAX_LOG_BYTES = 16 << 20


@dataclass(frozen=True)
class KubeHandle:
    """A started attempt as plain values the service stores: where its Job is, and the hub's
    folder for it."""

    owner: str
    run_id: int
    attempt: int
    namespace: str
    job: str
    secret: str
    node: str
    started_at: float
    attempt_dir: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KubeHandle:
        names = set(cls.__dataclass_fields__)
        missing = names - set(data)
        if missing:
            raise ValueError(f"a Kubernetes job handle needs {', '.join(sorted(missing))}")
        return cls(**{k: data[k] for k in names})

    def path(self, name: str) -> str:
        return os.path.join(self.attempt_dir, name)


def write_file(path: str, data: str | bytes) -> None:
    raw = data.encode() if isinstance(data, str) else data
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    os.replace(tmp, path)


def read_small_bytes(path: str, limit: int = MAX_LOG_BYTES) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(limit)


def read_small(path: str) -> str:
    return (read_small_bytes(path, 4096) or b"").decode(errors="replace").strip()


def read_log_copy(h: KubeHandle) -> bytes | None:
    """The final copy of the log, once the attempt has ended (None while it runs)."""
    if not os.path.exists(h.path("result.json")):
        return None
    final = read_small_bytes(h.path("log"))
    return final if final is not None else (read_small_bytes(h.path("log.partial")) or b"")


def read_result(h: KubeHandle) -> KubeOutcome | None:
    raw = read_small_bytes(h.path("result.json"), 4096)
    if not raw:
        return None
    try:
        return KubeOutcome.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError):
        return None


def mark_ended_by(h: KubeHandle, why: str) -> None:
    """Record why the hub ends the attempt; the first reason stays."""
    with contextlib.suppress(FileExistsError):
        fd = os.open(
            h.path("ended-by"),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        with os.fdopen(fd, "w") as f:
            f.write(why)


__all__ = [
    "MAX_LOG_BYTES",
    "KubeHandle",
    "mark_ended_by",
    "read_log_copy",
    "read_result",
    "read_small",
    "read_small_bytes",
    "write_file",
]
