"""The GPU-hour ledger's durable store (SQLAlchemy Core): intervals and the monitor's usage.

SQLite on the embedded default (`gpulab-ledger.sqlite` in the hub's state directory) and
PostgreSQL for cluster installs, the same engine set-up as the jobs and Dask stores. Every method
is synchronous and one transaction; async callers use ``asyncio.to_thread``.

Two processes write: the hub (intervals, at every allocator change and reconciliation) and the
gpulab-metrics service (usage, the GPU-seconds each server's monitor saw used). Both are hub-side
processes holding the hub's own database credentials; no user server can reach the database
(its URL and password are in the hub's and the service's environment only, never a server's),
so no tenant can write or read another's figures through it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection

from ..jobs.database import create_schema, make_engine, upsert, writing
from .model import Change, Holding, Interval, diff
from .rollup import UsageSample


@dataclasses.dataclass(frozen=True)
class LiveFigure:
    """One GPU slice's latest figures (see the `live` table)."""

    user: str
    server: str
    device: str
    t: float
    utilization_pct: float | None
    memory_used_mib: float | None
    memory_limit_mib: float | None
    below_since: float | None
    idle_threshold_pct: float


def figures_of_shares(
    devices: Sequence[str], figures: Mapping[str, LiveFigure]
) -> list[LiveFigure | None]:
    """The figure of each of a workload's devices (as the allocator names them), from the
    workload's pushed figures (as its monitor names the devices it sees). They are the same
    names on the embedded default. On Kubernetes the allocator holds logical slots ("node/gpu-0",
    "node/mig-2g.20gb-1") and the device plugin decides which physical device or MIG instance
    backs each, so a pod's monitor names others: when no name matches and the counts agree, the
    figures are the workload's own devices, paired in name order (which slot is which physical
    device is unknowable, and nothing here depends on it). Otherwise a device without its own
    figure has none (None)."""
    found: list[LiveFigure | None] = [figures.get(d) for d in devices]
    unmatched = [i for i, f in enumerate(found) if f is None]
    spare = [figures[k] for k in sorted(figures) if k not in set(devices)]
    if unmatched and len(spare) == len(unmatched):
        for i, figure in zip(unmatched, spare, strict=True):
            found[i] = figure
    return found


SCHEMA_VERSION = 1
SQLITE_FILE = "gpulab-ledger.sqlite"

metadata = sa.MetaData()

schema_version = sa.Table(
    "gpulab_ledger_schema",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
)

intervals = sa.Table(
    "gpulab_gpu_intervals",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("allocation_id", sa.Text, nullable=False, index=True),
    sa.Column("device", sa.Text, nullable=False),
    sa.Column("user", sa.Text, nullable=False, index=True),
    sa.Column("groups", sa.Text, nullable=False),  # JSON list
    sa.Column("workload", sa.Text, nullable=False),
    sa.Column("profile", sa.Text, nullable=False),
    sa.Column("gpu_model", sa.Text, nullable=False),
    sa.Column("mig_profile", sa.Text, nullable=True),
    sa.Column("node", sa.Text, nullable=False),
    sa.Column("milli", sa.Integer, nullable=False),
    sa.Column("tier", sa.Text, nullable=False),
    # whole seconds since the epoch; BigInteger: PostgreSQL's integer ends in 2038
    sa.Column("start", sa.BigInteger, nullable=False, index=True),
    sa.Column("end", sa.BigInteger, nullable=True, index=True),
    sa.Column("end_reason", sa.Text, nullable=True),
    sqlite_autoincrement=True,
)

usage = sa.Table(
    "gpulab_gpu_usage",
    metadata,
    sa.Column("user", sa.Text, primary_key=True),
    sa.Column("server", sa.Text, primary_key=True),
    sa.Column("device", sa.Text, primary_key=True),
    sa.Column("hour", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("used_gpu_seconds", sa.Float, nullable=False),
    sa.Column("sampled_seconds", sa.Float, nullable=False),
)

# The latest figures of each server's GPU slices, as gpulab-metrics last saw them (one row per
# user, server and device, replaced at every push): the admin panel's live columns and GPU-idle
# times, and the culler's slices. `below_since`: since when the slice's utilisation has stayed
# under the idle threshold without a gap (None: busy, or unknown).
live = sa.Table(
    "gpulab_gpu_live",
    metadata,
    sa.Column("user", sa.Text, primary_key=True),
    sa.Column("server", sa.Text, primary_key=True),
    sa.Column("device", sa.Text, primary_key=True),
    sa.Column("t", sa.Float, nullable=False),
    sa.Column("utilization_pct", sa.Float, nullable=True),
    sa.Column("memory_used_mib", sa.Float, nullable=True),
    sa.Column("memory_limit_mib", sa.Float, nullable=True),
    sa.Column("below_since", sa.Float, nullable=True),
    sa.Column("idle_threshold_pct", sa.Float, nullable=False),
)


def sqlite_url(state_dir: str | Path) -> str:
    """The embedded default's ledger: ``gpulab-ledger.sqlite`` in the hub's state directory."""
    return f"sqlite:///{Path(state_dir).resolve() / SQLITE_FILE}"


class LedgerStore:
    """Intervals and usage in SQLite or PostgreSQL."""

    def __init__(self, url: str | URL, *, clock: Callable[[], float] = time.time) -> None:
        self.engine = make_engine(url)
        self.clock = clock
        try:
            create_schema(
                self.engine,
                metadata,
                schema_version,
                SCHEMA_VERSION,
                lock_id=4242160018,
                what="GPU-hour ledger",
            )
        except BaseException:
            self.engine.dispose()
            raise

    def close(self) -> None:
        self.engine.dispose()

    # -- intervals -----------------------------------------------------------------------------

    def open_intervals(self) -> list[Interval]:
        with self.engine.connect() as conn:
            return self._open(conn)

    @staticmethod
    def _open(conn: Connection) -> list[Interval]:
        rows = conn.execute(
            sa.select(intervals).where(intervals.c.end.is_(None)).order_by(intervals.c.id)
        )
        return [_interval(r) for r in rows]

    def sync(self, now_held: Iterable[Holding], t: int, **kw: Any) -> Change:
        """Close and open intervals so that the open ones are exactly `now_held` from `t` on
        (`gpulab.hub.ledger.model.diff`'s keywords: reasons, live_nodes, started); one
        transaction, which holds the database's write lock from its start, so two writers never
        both open the same holding."""
        return self.sync_many([(list(now_held), t, kw)])[0]

    def sync_many(
        self, snapshots: Iterable[tuple[list[Holding], int, dict[str, Any]]]
    ) -> list[Change]:
        """`sync` for several snapshots in order, in one transaction (a writer that fell behind
        catches up without reading the open intervals once per snapshot)."""
        changes = []
        with writing(self.engine) as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(4242160019)"))
            open_now = {i.id: i for i in self._open(conn)}
            for held, t, kw in snapshots:
                change = diff(open_now.values(), held, t, **kw)
                change = self._after_last_end(conn, change, t)
                for interval_id, end, reason in change.close:
                    conn.execute(
                        intervals.update()
                        .where(intervals.c.id == interval_id, intervals.c.end.is_(None))
                        .values(end=end, end_reason=reason)
                    )
                    del open_now[interval_id]
                for holding, start in change.open:
                    result = conn.execute(intervals.insert().values(**_values(holding, start)))
                    key = result.inserted_primary_key
                    assert key is not None
                    new_id = int(key[0])
                    open_now[new_id] = Interval(new_id, holding, start)
                changes.append(change)
        return changes

    @staticmethod
    def _after_last_end(conn: Connection, change: Change, t: int) -> Change:
        """A holding opened before the write's time (its grant, found after a restart) starts
        no earlier than the last interval of the same share ended: never counted twice."""
        opened = []
        for holding, start in change.open:
            if start < t:
                last = conn.execute(
                    sa.select(sa.func.max(intervals.c.end)).where(
                        intervals.c.allocation_id == holding.allocation_id,
                        intervals.c.device == holding.device,
                    )
                ).scalar()
                if last is not None:
                    start = max(start, int(last))
            opened.append((holding, start))
        return Change(change.close, tuple(opened))

    def intervals(
        self, since: int, until: int, users: Collection[str] | None = None
    ) -> list[Interval]:
        """Intervals overlapping [since, until) (open ones included), oldest first."""
        query = sa.select(intervals).where(
            intervals.c.start < until,
            sa.or_(intervals.c.end.is_(None), intervals.c.end > since),
        )
        if users is not None:
            query = query.where(intervals.c.user.in_(sorted(users)))
        with self.engine.connect() as conn:
            return [_interval(r) for r in conn.execute(query.order_by(intervals.c.id))]

    def allocated_totals(self, until: int) -> list[tuple[str, str, str, int]]:
        """(user, profile, workload, milli-GPU-seconds) allocated ever, up to `until`: the
        Prometheus counters (monotonic while the clock is)."""
        end = sa.func.coalesce(intervals.c.end, until)
        amount = sa.func.sum(intervals.c.milli * (end - intervals.c.start))
        query = sa.select(
            intervals.c.user, intervals.c.profile, intervals.c.workload, amount
        ).group_by(intervals.c.user, intervals.c.profile, intervals.c.workload)
        with self.engine.connect() as conn:
            return [(u, p, w, int(a or 0)) for u, p, w, a in conn.execute(query)]

    # -- live figures --------------------------------------------------------------------------

    def put_live(self, figures: Iterable[LiveFigure]) -> None:
        """Replace the latest figures of these slices."""
        rows = [dataclasses.asdict(f) for f in figures]
        if not rows:
            return
        with writing(self.engine) as conn:
            stmt = upsert(conn, live)
            keys = ("user", "server", "device")
            stmt = stmt.on_conflict_do_update(
                index_elements=list(keys),
                set_={c: getattr(stmt.excluded, c) for c in rows[0] if c not in keys},
            )
            conn.execute(stmt, rows)

    def forget_live(self, servers: Iterable[tuple[str, str]]) -> None:
        """Drop the figures of servers that stopped."""
        pairs = list(servers)
        if not pairs:
            return
        with writing(self.engine) as conn:
            for user, server in pairs:
                conn.execute(live.delete().where(live.c.user == user, live.c.server == server))

    def live_figures(self, newer_than: float) -> list[LiveFigure]:
        """Every slice's latest figures taken after `newer_than` (older ones are stale)."""
        with self.engine.connect() as conn:
            return [_live(r) for r in conn.execute(sa.select(live).where(live.c.t > newer_than))]

    # -- usage ---------------------------------------------------------------------------------

    def used_totals(self) -> dict[str, float]:
        """GPU-seconds the monitor saw used, ever, per user (the Prometheus counters)."""
        query = sa.select(usage.c.user, sa.func.sum(usage.c.used_gpu_seconds)).group_by(
            usage.c.user
        )
        with self.engine.connect() as conn:
            return {u: float(s or 0.0) for u, s in conn.execute(query)}

    def add_usage(self, samples: Iterable[UsageSample]) -> None:
        """Add GPU-seconds used (and seconds sampled) to each sample's user/server/device/hour."""
        rows = [
            {
                "user": s.user,
                "server": s.server,
                "device": s.device,
                "hour": s.hour,
                "used_gpu_seconds": float(s.used_gpu_seconds),
                "sampled_seconds": float(s.sampled_seconds),
            }
            for s in samples
        ]
        if not rows:
            return
        with writing(self.engine) as conn:
            stmt = upsert(conn, usage)
            stmt = stmt.on_conflict_do_update(
                index_elements=["user", "server", "device", "hour"],
                set_={
                    "used_gpu_seconds": usage.c.used_gpu_seconds + stmt.excluded.used_gpu_seconds,
                    "sampled_seconds": usage.c.sampled_seconds + stmt.excluded.sampled_seconds,
                },
            )
            conn.execute(stmt, rows)

    def usage(
        self, since: int, until: int, users: Collection[str] | None = None
    ) -> list[UsageSample]:
        """Usage of the hours that start within [since, until)."""
        hour_of_since = since - since % 3600
        query = sa.select(usage).where(usage.c.hour >= hour_of_since, usage.c.hour < until)
        if users is not None:
            query = query.where(usage.c.user.in_(sorted(users)))
        with self.engine.connect() as conn:
            return [
                UsageSample(
                    r.user,
                    r.server,
                    r.device,
                    int(r.hour),
                    float(r.used_gpu_seconds),
                    float(r.sampled_seconds),
                )
                for r in conn.execute(query)
            ]


def _live(r: Any) -> LiveFigure:
    m = r._mapping  # not attributes: Row.t is SQLAlchemy's own (the row as a tuple)
    return LiveFigure(
        m["user"],
        m["server"],
        m["device"],
        float(m["t"]),
        _maybe(m["utilization_pct"]),
        _maybe(m["memory_used_mib"]),
        _maybe(m["memory_limit_mib"]),
        _maybe(m["below_since"]),
        float(m["idle_threshold_pct"]),
    )


def _maybe(value: Any) -> float | None:
    return None if value is None else float(value)


def _values(h: Holding, start: int) -> dict[str, Any]:
    return {
        "allocation_id": h.allocation_id,
        "device": h.device,
        "user": h.user,
        "groups": json.dumps(list(h.groups)),
        "workload": h.workload,
        "profile": h.profile,
        "gpu_model": h.gpu_model,
        "mig_profile": h.mig_profile,
        "node": h.node,
        "milli": h.milli,
        "tier": h.tier,
        "start": start,
    }


def _interval(r: Any) -> Interval:
    holding = Holding(
        allocation_id=r.allocation_id,
        device=r.device,
        user=r.user,
        groups=tuple(json.loads(r.groups)),
        workload=r.workload,
        profile=r.profile,
        gpu_model=r.gpu_model,
        mig_profile=r.mig_profile,
        node=r.node,
        milli=int(r.milli),
        tier=r.tier,
    )
    end = None if r.end is None else int(r.end)
    return Interval(int(r.id), holding, int(r.start), end, r.end_reason)
