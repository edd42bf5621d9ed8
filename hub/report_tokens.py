"""Report tokens: the credential a job run or a Dask worker pushes its GPU figures with.

A server's GPU monitor pushes to gpulab-metrics with the server's own token. A job run or a Dask
worker has no server token, and must not get one, nor any token of its owner's that reads or acts:
its code is user code, and what it holds is worth no more than it needs. So the hub issues each
workload that holds a GPU share a token of its own, when the share is granted:

- owned by the workload's owner (JupyterHub gives a token nothing its owner lacks: the `user`
  role holds `custom:gpulab:report-gpu!user`, see `gpulab.hub.config.add_dask`);
- holding one scope, `custom:gpulab:report-gpu!server=<owner>/<workload name>`: reporting GPU
  figures for that one workload, nothing else (no API read, no server access, not even another of
  her own workloads; gpulab-metrics checks the scope with the filter, push.authorize_push);
- revoked when the allocator gives the share back, however that happens (the run ended, was
  canceled or preempted, the worker was scaled away, the hub reconciled it away), since the
  revocation listens to the allocator itself; tokens of allocations no longer held are swept at
  start-up (a hub that died with runs in flight).

Another tenant cannot use it: it reaches the workload only as a private channel (the job
wrapper's spec, read from a hub-opened descriptor locally or the attempt's Secret on Kubernetes;
a Dask worker's environment, her own process or a Secret-backed variable of her own pod), and
the service refuses a token of one user for another's workload. Its owner gains nothing from it
either: it only says what her own workload's GPU did, which she could misreport anyway.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jupyterhub import orm

from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.scopes import REPORT_GPU
from gpulab.spawner.names import (
    MONITOR_SOURCE_ENV,
    PUSH_INTERVAL_ENV,
    PUSH_URL_ENV,
    REPORT_NAME_ENV,
    REPORT_TOKEN_ENV,
    REPORT_URL_ENV,
    REPORT_USER_ENV,
    SIMULATED_GPU_FILE_ENV,
    is_workload_name,
)

log = logging.getLogger("gpulab.report_tokens")

#: every report token's note starts so, followed by its allocation id ("alice/job-17")
NOTE_PREFIX = "gpulab GPU report for "
METRICS_SERVICE = "gpulab-metrics"


def workload_of(allocation_id: str) -> tuple[str, str] | None:
    """(owner, workload name) of a job run's or Dask worker's allocation id, else None."""
    owner, sep, name = allocation_id.rpartition("/")
    if not sep or not owner or not is_workload_name(name):
        return None
    return owner, name


def report_scope(owner: str, name: str) -> str:
    return f"{REPORT_GPU}!server={owner}/{name}"


class ReportTokens:
    """Issues report tokens in the hub's database and revokes them with their shares (see the
    module docstring). One per hub: `ReportTokens.of(app)`."""

    def __init__(self, app: Any, capacity: GPUCapacity) -> None:
        self.app = app
        self.capacity = capacity
        self.loop = asyncio.get_running_loop()
        capacity.allocator.add_listener(self._on_change)
        self.issued = 0
        self.revoked = 0

    @classmethod
    def of(cls, app: Any) -> ReportTokens:
        """The hub's instance (made on first use, in the hub's event loop)."""
        found: ReportTokens | None = getattr(app, "_gpulab_report_tokens", None)
        if found is None:
            found = cls(app, GPUCapacity.instance(config=app.config, log=app.log))
            app._gpulab_report_tokens = found
        return found

    # -- where to push -------------------------------------------------------------------------

    def push_settings(self) -> tuple[str, float, dict[str, str]] | None:
        """(push URL, interval, monitor settings) as every server gets them, None when the hub
        runs no gpulab-metrics (`gpulab.hub.config.add_services` sets the first two in
        Spawner.environment; an admin may choose the monitor's source there too)."""
        env = self.app.config.Spawner.get("environment")
        values = env if isinstance(env, dict) else {}
        if not values and env is not None:
            values = env.get_value({})  # a LazyConfigValue (.update() without assignment)
        url = str(values.get(PUSH_URL_ENV, "")).strip()
        if not url or not any(
            s.get("name") == METRICS_SERVICE for s in self.app.services if isinstance(s, dict)
        ):
            return None
        try:
            interval = float(values.get(PUSH_INTERVAL_ENV, "15"))
        except ValueError:
            interval = 15.0
        monitor = {
            k: str(values[k]) for k in (MONITOR_SOURCE_ENV, SIMULATED_GPU_FILE_ENV) if values.get(k)
        }
        return url, interval, monitor

    # -- issue and revoke ----------------------------------------------------------------------

    def issue(self, allocation_id: str) -> dict[str, str] | None:
        """The report of the workload holding `allocation_id` (REPORT_*_ENV and the interval,
        as a mapping), with a new token; None when the hub runs no gpulab-metrics or the
        allocation is no job run's or Dask worker's. Any token it had before is revoked first
        (a retried attempt gets a fresh one). Call it once the share is held."""
        workload = workload_of(allocation_id)
        settings = self.push_settings()
        if workload is None or settings is None:
            return None
        owner, name = workload
        orm_user = orm.User.find(self.app.db, owner)
        if orm_user is None:
            return None
        self.revoke(allocation_id)
        token = orm_user.new_api_token(
            note=f"{NOTE_PREFIX}{allocation_id}", scopes=[report_scope(owner, name)]
        )
        self.issued += 1
        url, interval, monitor = settings
        # the same address servers push to (not a secret), and the same way of measuring as the
        # servers' monitors (an admin's choice of source); the token is the secret part
        return {
            **monitor,
            REPORT_URL_ENV: url,
            REPORT_TOKEN_ENV: token,
            REPORT_NAME_ENV: name,
            REPORT_USER_ENV: owner,
            PUSH_INTERVAL_ENV: f"{interval:g}",
        }

    def revoke(self, allocation_id: str) -> int:
        """Delete every report token of `allocation_id`; how many there were."""
        db = self.app.db
        found = (
            db.query(orm.APIToken)
            .filter(orm.APIToken.note == f"{NOTE_PREFIX}{allocation_id}")
            .all()
        )
        for token in found:
            db.delete(token)
        if found:
            db.commit()
            self.revoked += len(found)
        return len(found)

    def sweep(self) -> int:
        """Revoke the report tokens of allocations the allocator no longer holds (a hub that
        stopped with workloads running, a release while the database could not be written)."""
        held = {p.request.id for p in self.capacity.allocator.allocations()}
        db = self.app.db
        stale = [
            t
            for t in db.query(orm.APIToken).filter(orm.APIToken.note.startswith(NOTE_PREFIX)).all()
            if t.note[len(NOTE_PREFIX) :] not in held
        ]
        for token in stale:
            db.delete(token)
        if stale:
            db.commit()
            self.revoked += len(stale)
            log.info("gpulab: revoked %d report token(s) of shares no longer held", len(stale))
        return len(stale)

    def _on_change(self, placements: list[Any], removed: dict[str, str]) -> None:
        """The allocator's listener (inside its lock, maybe in a worker thread): revocations go
        to the hub's loop, which owns the database session."""
        gone = [a for a in removed if workload_of(a) is not None]
        if gone:
            self.loop.call_soon_threadsafe(self._revoke_all, gone)

    def _revoke_all(self, allocation_ids: list[str]) -> None:
        for allocation_id in allocation_ids:
            try:
                self.revoke(allocation_id)
            except Exception:  # the start-up sweep removes it next time
                log.exception("gpulab: revoking the report token of %s failed", allocation_id)
