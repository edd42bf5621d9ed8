"""What the Kubernetes Dask executor reads of a cluster's objects: the handles that name a
scheduler's or worker's objects (`KubeDaskHandle`, what the cluster service stores), and the pure
readers of a pod's end, its readiness and a node's loss (dicts in, as the API server returns).

Apart from the executor in `dask.py`, which makes the API calls, so that these are tested on
the real shapes without a cluster (`tests/spawner/kube/test_dask_outcomes.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from gpulab.spawner.kube.dask_settings import (
    OPERATOR_CLUSTER_LABEL,
    OPERATOR_COMPONENT_LABEL,
    OPERATOR_WORKERGROUP_LABEL,
    worker_group_name,
)


@dataclass(frozen=True)
class KubeDaskHandle:
    """A scheduler (`worker` None) or worker as plain values the service stores."""

    owner: str
    cluster_id: int
    namespace: str
    cluster: str
    worker: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KubeDaskHandle:
        try:
            worker = data.get("worker")
            return cls(
                owner=str(data["owner"]),
                cluster_id=int(data["cluster_id"]),
                namespace=str(data["namespace"]),
                cluster=str(data["cluster"]),
                worker=None if worker is None else int(worker),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a Kubernetes Dask handle: {e}") from None

    @property
    def pod_selector(self) -> str:
        """The label selector of its pods (the operator's labels)."""
        if self.worker is None:
            return f"{OPERATOR_CLUSTER_LABEL}={self.cluster},{OPERATOR_COMPONENT_LABEL}=scheduler"
        return f"{OPERATOR_WORKERGROUP_LABEL}={worker_group_name(self.cluster, self.worker)}"


def container_end_reason(pod: Mapping[str, Any]) -> str:
    """The last end of the pod's container, for people: "OOMKilled", "exited with status 1",
    "" when it never ended."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (status.get("state") or {}, status.get("lastState") or {}):
            terminated = state.get("terminated")
            if not terminated:
                continue
            reason, code = str(terminated.get("reason") or ""), terminated.get("exitCode")
            if reason and reason not in ("Error", "Completed"):
                return reason
            if code is not None:
                return f"exited with status {code}"
    return ""


def node_lost_for(node: Mapping[str, Any] | None, now: float) -> float:
    """Seconds `node` (a Node, None when gone) has not been Ready; 0 when Ready."""
    if node is None:
        return float("inf")
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") != "Ready":
            continue
        if condition.get("status") == "True":
            return 0.0
        since = condition.get("lastTransitionTime")
        if not since:
            return float("inf")
        # RFC 3339 as the API server writes it ("...Z"), or the client's isoformat ("+00:00")
        at = (
            since
            if isinstance(since, datetime)
            else datetime.fromisoformat(str(since).replace("Z", "+00:00"))
        )
        if at.tzinfo is None:
            at = at.replace(tzinfo=timezone.utc)
        return max(0.0, now - at.timestamp())
    return 0.0


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


__all__ = ["KubeDaskHandle", "container_end_reason", "node_lost_for", "pod_ready"]
