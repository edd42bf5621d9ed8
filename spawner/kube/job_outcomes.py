"""How an attempt of a job run on Kubernetes ended, read from the Job and pod the API server
returns: `KubeOutcome` (the service's `JobOutcome`) and the pure readers of the Job's conditions,
the pod's container statuses and the job wrapper's outputs line at the end of the pod's log.

Pure (dicts in, values out), apart from `jobs.py`'s API calls, so that they are tested on the
real shapes without a cluster (`tests/spawner/kube/test_job_outcomes.py`), and the Dask executor
reads its pods with the same `pod_is_live` and `waiting_reason`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpulab.hub.jobs import Cancel, Event, Fail, Preempt, Succeed, TimeOut
from gpulab.spawner.kube.job_objects import CONTAINER_NAME
from gpulab.spawner.singleuser.jobwrapper import (
    BEFORE_USER_CODE,
    OUTPUTS_PREFIX,
    platform_failure_cause,
)


@dataclass(frozen=True)
class KubeOutcome:
    """How an attempt ended (`gpulab.hub.jobservice.JobOutcome`). `kind`: succeeded, failed,
    timed_out, canceled or lost (its node was lost: the run is preempted and retried)."""

    kind: str
    reason: str = ""
    exit_code: int | None = None
    #: failed before the job's own code started (never ran, evicted, its kernel did not start)
    platform_failure: bool = False

    def event(self, at: float) -> Event:
        if self.kind == "succeeded":
            return Succeed(at)
        if self.kind == "timed_out":
            return TimeOut(at)
        if self.kind == "canceled":
            return Cancel(at)
        if self.kind == "lost":
            return Preempt(at, reason=self.reason, platform_failure=True)
        return Fail(
            at,
            reason=self.reason or "failed",
            exit_code=self.exit_code,
            platform_failure=self.platform_failure,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KubeOutcome:
        code = data.get("exit_code")
        return cls(
            str(data["kind"]),
            str(data.get("reason") or ""),
            None if code is None else int(code),
            bool(data.get("platform_failure", False)),
        )


# -- what the cluster says (pure: dicts in) --------------------------------------------------------


def pod_is_live(pod: Mapping[str, Any]) -> bool:
    """A pod that may still run something: not Succeeded or Failed (Terminating counts)."""
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def job_finished(job: Mapping[str, Any]) -> tuple[str, str] | None:
    """("Complete" | "Failed", reason) once the Job controller has decided, else None."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Complete", "Failed"):
            return str(condition["type"]), str(condition.get("reason") or "")
    return None


def container_end(pod: Mapping[str, Any] | None) -> tuple[int | None, str]:
    """The job container's exit code and the kubelet's reason (None, '' when it has none)."""
    for status in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != CONTAINER_NAME:
            continue
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            return terminated.get("exitCode"), str(terminated.get("reason") or "")
    return None, ""


def waiting_reason(pod: Mapping[str, Any] | None) -> str:
    """Why the job container does not run yet, as the kubelet says (e.g. 'ImagePullBackOff:
    ...'), or the pod's own condition; '' when nothing is known."""
    for status in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            message = str(waiting.get("message") or "")
            return f"{waiting['reason']}: {message}"[:300] if message else str(waiting["reason"])
    for condition in ((pod or {}).get("status") or {}).get("conditions") or []:
        if condition.get("status") == "False" and condition.get("message"):
            return str(condition["message"])[:300]
    return ""


def creation_failure(events: Sequence[Mapping[str, Any]]) -> str:
    """The newest message of the Job controller's `FailedCreate` events of a Job (why it made
    no pod: Pod Security, a ResourceQuota, a webhook), '' when there is none. `events`: core/v1
    Events whose involvedObject is the Job."""
    failed = [e for e in events if e.get("reason") == "FailedCreate" and e.get("message")]
    if not failed:
        return ""
    newest = max(failed, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return str(newest["message"])[:600]


def refused_by_pod_security(message: str) -> bool:
    """A `creation_failure` that no retry can cure: the namespace's Pod Security admission
    refuses every pod the Job would make (the same pod again), until an admin changes the
    servers' hardening or the namespace's level."""
    return "violates PodSecurity" in message


def finished_outcome(
    job: Mapping[str, Any], pod: Mapping[str, Any] | None, log: bytes = b""
) -> KubeOutcome:
    """The outcome of a Job the controller has finished (`job_finished`), its pod ended; `log`:
    the end of the pod's log, where the wrapper says why an attempt failed before the job's own
    code started (with exit code `BEFORE_USER_CODE`)."""
    finished = job_finished(job)
    assert finished is not None
    kind, reason = finished
    if kind == "Complete":
        return KubeOutcome("succeeded")
    if reason == "DeadlineExceeded":
        return KubeOutcome("timed_out", "timed out")
    status = (pod or {}).get("status") or {}
    if status.get("reason") == "Evicted":  # the kubelet took the node's memory or disk back
        why = str(status.get("message") or "no message")[:300]
        return KubeOutcome("failed", f"evicted by its node: {why}", None, platform_failure=True)
    code, why = container_end(pod)
    cause = platform_failure_cause(log) if code == BEFORE_USER_CODE else None
    if cause is not None:
        reason = f"failed before the job's code started: {cause}"
        return KubeOutcome("failed", reason, code, platform_failure=True)
    if code is not None:
        return KubeOutcome("failed", f"exit code {code}" if code else why or "failed", code)
    return KubeOutcome("failed", f"its Job failed ({reason or 'no reason given'})")


def outputs_from_log(data: bytes) -> list[tuple[str, int]]:
    """The files of the last outputs line the job wrapper wrote (`--list-outputs`); [] when
    there is none or it is not the wrapper's shape."""
    marker = OUTPUTS_PREFIX.encode()
    at = data.rfind(b"\n" + marker)
    if at < 0:
        if not data.startswith(marker):
            return []
        at = -1
    line = data[at + 1 + len(marker) :].split(b"\n", 1)[0]
    try:
        listing = json.loads(line)
        files = [(str(path), int(size)) for path, size in listing["files"]]
    except (ValueError, TypeError, KeyError):
        return []
    return [(p, s) for p, s in files if p and not p.startswith(("/", "../")) and s >= 0]


__all__ = [
    "KubeOutcome",
    "container_end",
    "finished_outcome",
    "job_finished",
    "outputs_from_log",
    "pod_is_live",
    "waiting_reason",
]
