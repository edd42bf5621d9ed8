"""The durable store of Dask clusters, their workers and the executors' handles (SQLAlchemy Core).

The same engines as the jobs store (``gpulab.hub.jobs.database.make_engine``): SQLite on the
embedded default, PostgreSQL where several hub workers or a restarted hub share one database.
Why a store at all, when the allocator persists allocations: a cluster outlives its server
(keep-alive) and the hub (its processes and pods are no children of the hub), so after a restart
the hub must know which allocations are a cluster's (``live_allocation_ids``), which server each
cluster stops with, and how to find each worker's process or pod again (its handle).

Every method is synchronous and one transaction: from async code call it through
``await asyncio.to_thread(store.method, ...)``. State changes are compare-and-set, as in the jobs
store: ``transition(id, event, expected_state=...)`` writes only if the cluster is still in the
state (and version) the caller decided on and returns None otherwise, so of two hub workers that
both admitted a worker from the same copy exactly one wins, and the other releases its share.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from ..jobs.database import create_schema, dumps, make_engine, upsert, writing
from ..jobs.model import PlacementSummary
from .allocations import scheduler_allocation_id, worker_allocation_id
from .model import (
    FINAL_CLUSTER_STATES,
    HOLDING_WORKER_STATES,
    SCHEDULER_HOLDING_STATES,
    Cluster,
    ClusterEvent,
    ClusterState,
    Worker,
    WorkerEvent,
    WorkerState,
    transition_cluster,
    transition_worker,
)
from .spec import ClusterSpec

#: The schema this code writes. A database of a newer one is refused rather than misread.
SCHEMA_VERSION = 1
#: The SQLite file's name in the hub's state directory.
SQLITE_FILE = "gpulab-dask.sqlite"

metadata = sa.MetaData()

schema_version = sa.Table(
    "gpulab_dask_schema",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
)

clusters = sa.Table(
    "gpulab_dask_clusters",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("owner", sa.Text, nullable=False, index=True),
    sa.Column("name", sa.Text, nullable=False),
    # the name while the cluster lives, NULL once it ended: the unique index below makes a live
    # name one cluster's on SQLite and PostgreSQL alike (NULLs never collide), so two hub
    # workers creating "train" for alice at once cannot both succeed
    sa.Column("live_name", sa.Text, nullable=True),
    sa.Column("server", sa.Text, nullable=False),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("state", sa.Text, nullable=False, index=True),
    sa.Column("target", sa.Integer, nullable=False),
    sa.Column("minimum", sa.Integer, nullable=True),
    sa.Column("maximum", sa.Integer, nullable=True),
    sa.Column("keep_alive", sa.Boolean, nullable=False),
    sa.Column("scheduler", sa.Text, nullable=True),
    sa.Column("scheduler_address", sa.Text, nullable=False),
    sa.Column("dashboard_url", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("failed", sa.Boolean, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.UniqueConstraint("owner", "live_name", name="gpulab_dask_clusters_live_name"),
    # ids are never reused: a dashboard URL or allocation id must not come to mean another cluster
    sqlite_autoincrement=True,
)

workers = sa.Table(
    "gpulab_dask_workers",
    metadata,
    sa.Column("cluster_id", sa.Integer, sa.ForeignKey("gpulab_dask_clusters.id"), primary_key=True),
    sa.Column("number", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("state", sa.Text, nullable=False, index=True),
    sa.Column("placement", sa.Text, nullable=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
)

# What an executor needs to find the scheduler's or a worker's process or pod again after a hub
# restart (a pid and start time, an object's name): its own JSON, opaque to the store.
handles = sa.Table(
    "gpulab_dask_handles",
    metadata,
    sa.Column("cluster_id", sa.Integer, sa.ForeignKey("gpulab_dask_clusters.id"), primary_key=True),
    # "scheduler", or the worker's name ("w3")
    sa.Column("component", sa.Text, primary_key=True),
    sa.Column("handle", sa.Text, nullable=False),
)


class ClusterNotFound(KeyError):
    """No cluster (or worker) with that id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class ClusterNameTaken(ValueError):
    """The owner has a live cluster of that name already (the REST API: 409, field ``name``)."""

    field = "name"


class ClusterEnded(ValueError):
    """Workers were asked for a cluster that is stopping or stopped."""


def sqlite_url(state_dir: str | Path) -> str:
    """The embedded default's database: ``gpulab-dask.sqlite`` in the hub's state directory."""
    return f"sqlite:///{Path(state_dir).resolve() / SQLITE_FILE}"


class ClusterStore:
    """Clusters, workers and handles in one database (see the module doc).

    Synchronous; call it from async code with ``asyncio.to_thread``. Every method is one
    transaction. ``clock`` gives the time of creations (events carry their own).
    """

    def __init__(self, url: str | URL, *, clock: Callable[[], float] = time.time) -> None:
        self.engine = make_engine(url)
        self.clock = clock
        try:
            self._create_schema()
        except BaseException:
            self.engine.dispose()
            raise

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    def _create_schema(self) -> None:
        create_schema(
            self.engine,
            metadata,
            schema_version,
            SCHEMA_VERSION,
            lock_id=4242160017,
            what="Dask clusters",
        )

    # -- clusters ------------------------------------------------------------------------------

    def create(self, spec: ClusterSpec) -> Cluster:
        """Store a new pending cluster; ``ClusterNameTaken`` when the owner has a live one of
        that name."""
        now = self.clock()
        draft = Cluster.created(0, spec, now)
        values = _cluster_values(draft)
        del values["id"]
        try:
            with writing(self.engine) as conn:
                cluster_id = conn.execute(
                    clusters.insert().values(**values).returning(clusters.c.id)
                ).scalar_one()
        except sa.exc.IntegrityError:
            raise ClusterNameTaken(
                f"you have a cluster named {spec.name!r} already: connect to it by its name, "
                "stop it, or choose another name"
            ) from None
        return Cluster.created(int(cluster_id), spec, now)

    def get(self, cluster_id: int) -> Cluster:
        """The cluster, or ``ClusterNotFound``."""
        with self.engine.connect() as conn:
            row = conn.execute(clusters.select().where(clusters.c.id == cluster_id)).first()
        if row is None:
            raise ClusterNotFound(f"no Dask cluster {cluster_id}")
        return _cluster(row)

    def find(self, owner: str, name: str) -> Cluster | None:
        """The owner's live cluster named ``name`` (``GPUCluster.from_name``), or None."""
        with self.engine.connect() as conn:
            row = conn.execute(
                clusters.select().where(clusters.c.owner == owner, clusters.c.live_name == name)
            ).first()
        return None if row is None else _cluster(row)

    def list_clusters(
        self, *, owner: str | None = None, states: Collection[ClusterState] | None = None
    ) -> list[Cluster]:
        """Clusters, oldest first; of ``owner`` and in ``states`` when given."""
        query = clusters.select().order_by(clusters.c.id)
        if owner is not None:
            query = query.where(clusters.c.owner == owner)
        if states is not None:
            query = query.where(clusters.c.state.in_([s.value for s in states]))
        with self.engine.connect() as conn:
            return [_cluster(row) for row in conn.execute(query)]

    def transition(
        self,
        cluster_id: int,
        event: ClusterEvent,
        *,
        expected_state: ClusterState,
        expected_version: int | None = None,
    ) -> Cluster | None:
        """Apply ``event`` if the cluster is still in ``expected_state`` (and at
        ``expected_version`` when given); the changed cluster, or None when another writer
        changed it first. ``ClusterNotFound``; ``IllegalTransition`` (a caller's bug, not a
        race) when the event is not allowed from the expected state."""
        with writing(self.engine) as conn:
            row = conn.execute(clusters.select().where(clusters.c.id == cluster_id)).first()
            if row is None:
                raise ClusterNotFound(f"no Dask cluster {cluster_id}")
            current = _cluster(row)
            if current.state is not expected_state or (
                expected_version is not None and current.version != expected_version
            ):
                return None
            changed = transition_cluster(current, event)
            values = _cluster_values(changed)
            del values["id"]
            # the compare-and-set: written only if nobody changed the row since the read above
            result = conn.execute(
                clusters.update()
                .where(
                    clusters.c.id == cluster_id,
                    clusters.c.state == current.state.value,
                    clusters.c.version == current.version,
                )
                .values(**values)
            )
            return changed if result.rowcount == 1 else None

    # -- workers -------------------------------------------------------------------------------

    def add_workers(self, cluster_id: int, count: int) -> list[Worker]:
        """``count`` new pending workers, numbered after every worker the cluster ever had
        (numbers are never reused). ``ClusterEnded`` once the cluster is no longer live."""
        if count < 0:
            raise ValueError(f"a worker count is >= 0, got {count}")
        now = self.clock()
        with writing(self.engine) as conn:
            # FOR UPDATE: two PostgreSQL writers adding workers to one cluster take turns (and
            # the second sees the first's numbers); SQLite's writer lock does the same already
            row = conn.execute(
                clusters.select().where(clusters.c.id == cluster_id).with_for_update()
            ).first()
            if row is None:
                raise ClusterNotFound(f"no Dask cluster {cluster_id}")
            cluster = _cluster(row)
            if not cluster.is_live:
                raise ClusterEnded(
                    f"cluster {cluster.name!r} is {cluster.state.value}: it takes no workers"
                )
            last = conn.execute(
                sa.select(sa.func.max(workers.c.number)).where(workers.c.cluster_id == cluster_id)
            ).scalar()
            added = [
                Worker(cluster_id, (last or 0) + i, WorkerState.PENDING, now, updated_at=now)
                for i in range(1, count + 1)
            ]
            if added:
                conn.execute(workers.insert(), [_worker_values(w) for w in added])
            return added

    def workers(
        self, cluster_id: int, *, states: Collection[WorkerState] | None = None
    ) -> list[Worker]:
        """The cluster's workers by number; in ``states`` when given."""
        query = workers.select().where(workers.c.cluster_id == cluster_id)
        if states is not None:
            query = query.where(workers.c.state.in_([s.value for s in states]))
        with self.engine.connect() as conn:
            return [_worker(row) for row in conn.execute(query.order_by(workers.c.number))]

    def get_worker(self, cluster_id: int, number: int) -> Worker:
        """One worker, or ``ClusterNotFound``."""
        with self.engine.connect() as conn:
            row = conn.execute(_worker_row(cluster_id, number)).first()
        if row is None:
            raise ClusterNotFound(f"no worker w{number} in Dask cluster {cluster_id}")
        return _worker(row)

    def transition_worker(
        self,
        cluster_id: int,
        number: int,
        event: WorkerEvent,
        *,
        expected_state: WorkerState,
        expected_version: int | None = None,
    ) -> Worker | None:
        """Compare-and-set of one worker, as ``transition`` is of a cluster."""
        with writing(self.engine) as conn:
            row = conn.execute(_worker_row(cluster_id, number)).first()
            if row is None:
                raise ClusterNotFound(f"no worker w{number} in Dask cluster {cluster_id}")
            current = _worker(row)
            if current.state is not expected_state or (
                expected_version is not None and current.version != expected_version
            ):
                return None
            changed = transition_worker(current, event)
            result = conn.execute(
                workers.update()
                .where(
                    workers.c.cluster_id == cluster_id,
                    workers.c.number == number,
                    workers.c.state == current.state.value,
                    workers.c.version == current.version,
                )
                .values(**_worker_values(changed))
            )
            return changed if result.rowcount == 1 else None

    # -- handles and allocations ---------------------------------------------------------------

    def set_handle(self, cluster_id: int, component: str, handle: Mapping[str, Any]) -> None:
        """Record the executor's handle of the scheduler (``component="scheduler"``) or of a
        worker (its name), replacing an earlier one."""
        with writing(self.engine) as conn:
            insert = upsert(conn, handles).values(
                cluster_id=cluster_id, component=component, handle=dumps(dict(handle))
            )
            conn.execute(
                insert.on_conflict_do_update(
                    index_elements=[handles.c.cluster_id, handles.c.component],
                    set_={"handle": insert.excluded.handle},
                )
            )

    def handle(self, cluster_id: int, component: str) -> dict[str, Any] | None:
        """The executor's handle, or None when none was recorded (the hub stopped between
        placing and starting it)."""
        with self.engine.connect() as conn:
            value = conn.execute(
                sa.select(handles.c.handle).where(
                    (handles.c.cluster_id == cluster_id) & (handles.c.component == component)
                )
            ).scalar_one_or_none()
        return None if value is None else dict(json.loads(value))

    def live_allocation_ids(self) -> set[str]:
        """The allocations clusters hold now: schedulers of clusters that hold one and workers
        that hold one. The hub's reconciliation keeps these (``GPUCapacity.keep_allocations``)."""
        holding_clusters = [s.value for s in SCHEDULER_HOLDING_STATES]
        holding_workers = [s.value for s in HOLDING_WORKER_STATES]
        with self.engine.connect() as conn:
            ids = {
                scheduler_allocation_id(row.owner, int(row.id))
                for row in conn.execute(
                    sa.select(clusters.c.id, clusters.c.owner).where(
                        clusters.c.state.in_(holding_clusters)
                    )
                )
            }
            ids |= {
                worker_allocation_id(row.owner, int(row.cluster_id), int(row.number))
                for row in conn.execute(
                    sa.select(workers.c.cluster_id, workers.c.number, clusters.c.owner)
                    .join(clusters, clusters.c.id == workers.c.cluster_id)
                    .where(workers.c.state.in_(holding_workers))
                )
            }
        return ids


# -- rows <-> values ----------------------------------------------------------------------------


def _worker_row(cluster_id: int, number: int) -> Any:
    return workers.select().where(workers.c.cluster_id == cluster_id, workers.c.number == number)


def _cluster_values(cluster: Cluster) -> dict[str, Any]:
    return {
        "id": cluster.id,
        "owner": cluster.owner,
        "name": cluster.name,
        "live_name": None if cluster.state in FINAL_CLUSTER_STATES else cluster.name,
        "server": cluster.spec.server,
        "spec": dumps(cluster.spec.to_dict()),
        "state": cluster.state.value,
        "target": cluster.target,
        "minimum": cluster.minimum,
        "maximum": cluster.maximum,
        "keep_alive": cluster.keep_alive,
        "scheduler": None if cluster.scheduler is None else dumps(cluster.scheduler.to_dict()),
        "scheduler_address": cluster.scheduler_address,
        "dashboard_url": cluster.dashboard_url,
        "reason": cluster.reason,
        "failed": cluster.failed,
        "created_at": cluster.created_at,
        "updated_at": cluster.updated_at,
        "version": cluster.version,
    }


def _cluster(row: Any) -> Cluster:
    return Cluster(
        id=int(row.id),
        spec=ClusterSpec.from_dict(json.loads(row.spec)),
        state=ClusterState(row.state),
        created_at=float(row.created_at),
        target=int(row.target),
        minimum=None if row.minimum is None else int(row.minimum),
        maximum=None if row.maximum is None else int(row.maximum),
        keep_alive=bool(row.keep_alive),
        scheduler=None
        if row.scheduler is None
        else PlacementSummary.from_dict(json.loads(row.scheduler)),
        scheduler_address=row.scheduler_address,
        dashboard_url=row.dashboard_url,
        reason=row.reason,
        failed=bool(row.failed),
        updated_at=float(row.updated_at),
        version=int(row.version),
    )


def _worker_values(worker: Worker) -> dict[str, Any]:
    return {
        "cluster_id": worker.cluster_id,
        "number": worker.number,
        "state": worker.state.value,
        "placement": None if worker.placement is None else dumps(worker.placement.to_dict()),
        "reason": worker.reason,
        "created_at": worker.created_at,
        "updated_at": worker.updated_at,
        "version": worker.version,
    }


def _worker(row: Any) -> Worker:
    return Worker(
        cluster_id=int(row.cluster_id),
        number=int(row.number),
        state=WorkerState(row.state),
        created_at=float(row.created_at),
        placement=None
        if row.placement is None
        else PlacementSummary.from_dict(json.loads(row.placement)),
        reason=row.reason,
        updated_at=float(row.updated_at),
        version=int(row.version),
    )
