"""When a cluster ends: with its server, after an idle timeout, and how fast its parts must go.

Pure rules; the cluster service applies them. A cluster stops

- when its owner stops it (the notebook's ``cluster.close()``, the sidebar, the REST API);
- when the server it was created from stops, unless ``keep_alive`` is set (then it lives on,
  listed under its owner, until she stops it or it idles out);
- when it has been idle for its idle timeout, keep-alive or not: a forgotten cluster must not
  hold GPUs for good. Idle means that the scheduler has no task (processing, queued or waiting)
  and no client is connected (the hub's own monitoring connection is not a client). A connected
  client keeps it: an idle kernel holding a ``Client`` is the server's idle culler's to end,
  which then stops the cluster with the server unless it is kept alive.

Stopping is bounded: workers get ``WORKER_STOP_GRACE_SECONDS`` after SIGTERM (or the pod's
deletion) to leave, then are killed, so that nothing of a cluster runs ``SHUTDOWN_LIMIT_SECONDS``
after its shutdown began (the issue's contract; the tests check it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .model import Cluster, ClusterState

#: Nothing of a cluster (no worker process or pod, no scheduler) runs this long after its
#: shutdown began.
SHUTDOWN_LIMIT_SECONDS = 60
#: A worker's time to leave after SIGTERM before it is killed; with the scheduler's own grace
#: after the workers are gone, well inside ``SHUTDOWN_LIMIT_SECONDS``.
WORKER_STOP_GRACE_SECONDS = 20
#: The scheduler's time to leave after SIGTERM, once its workers are gone.
SCHEDULER_STOP_GRACE_SECONDS = 10


@dataclass(frozen=True)
class Activity:
    """What the scheduler said at ``at``: its tasks (processing, queued, waiting) and the
    clients connected to it, not counting the hub's own monitoring connection."""

    at: float
    tasks: int
    clients: int

    @property
    def busy(self) -> bool:
        return self.tasks > 0 or self.clients > 0


def next_idle_since(previous: float | None, activity: Activity) -> float | None:
    """Since when the cluster has been idle after ``activity``: None while busy, else the
    earlier idle start (or now, when it just became idle)."""
    if activity.busy:
        return None
    return activity.at if previous is None else min(previous, activity.at)


def idle_timeout(cluster: Cluster, default_seconds: int, max_seconds: int) -> int:
    """The cluster's idle timeout: its spec's, else the hub's default, and never more than the
    hub's maximum (an admin's cap applies to clusters created before it was lowered too)."""
    asked = cluster.spec.idle_timeout_seconds
    return min(asked if asked is not None else default_seconds, max_seconds)


def idle_expired(
    cluster: Cluster, idle_since: float | None, now: float, timeout_seconds: int
) -> bool:
    """Whether a running cluster idle since ``idle_since`` has reached its timeout. Only a
    running cluster idles: one still starting has had no chance to be used."""
    if cluster.state is not ClusterState.RUNNING or idle_since is None:
        return False
    return now - idle_since >= timeout_seconds


def idle_stop_reason(timeout_seconds: int) -> str:
    """The reason a cluster stopped for idling, for its owner."""
    return f"idle for {timeout_seconds} s (no tasks and no client connected)"


def stops_with_server(cluster: Cluster, owner: str, server: str) -> bool:
    """Whether the stop of ``owner``'s server ``server`` ("" for the default server) stops
    ``cluster``: a live cluster created from that server and not kept alive."""
    return (
        cluster.is_live
        and not cluster.keep_alive
        and cluster.owner == owner
        and cluster.spec.server == server
    )


def clusters_to_stop_with_server(
    clusters: Iterable[Cluster], owner: str, server: str
) -> list[Cluster]:
    """The clusters the stop of ``owner``'s server ``server`` stops (``stops_with_server``)."""
    return [c for c in clusters if stops_with_server(c, owner, server)]


def server_stop_reason(server: str) -> str:
    """The reason a cluster stopped with its server."""
    which = f"server {server!r}" if server else "default server"
    return f"stopped with its {which} (not kept alive)"


@dataclass(frozen=True)
class StopSchedule:
    """When each step of a shutdown that began at ``began`` is due: workers are killed at
    ``kill_workers_at`` if still there, the scheduler at ``kill_scheduler_at``, and by
    ``deadline`` nothing of the cluster may run."""

    began: float
    kill_workers_at: float
    kill_scheduler_at: float
    deadline: float


def stop_schedule(began: float) -> StopSchedule:
    """The shutdown's schedule (see the module docstring)."""
    kill_workers = began + WORKER_STOP_GRACE_SECONDS
    return StopSchedule(
        began=began,
        kill_workers_at=kill_workers,
        kill_scheduler_at=kill_workers + SCHEDULER_STOP_GRACE_SECONDS,
        deadline=began + SHUTDOWN_LIMIT_SECONDS,
    )
