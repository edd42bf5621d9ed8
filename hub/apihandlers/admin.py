"""The GPU admin panel's REST: every workload with its GPU, and bulk actions on them.

    GET  /hub/api/gpulab/admin/overview   every allocation as a workload, every node's GPUs
    POST /hub/api/gpulab/admin/actions    {"action": "stop" | "preempt", "ids": [allocation ids]}

Both need `custom:gpulab:admin-read` (the panel's scope); each action needs more, checked per
workload with JupyterHub's scope machinery on its owner: stopping a server JupyterHub's own
`delete:servers` (what its DELETE /users/{name}/servers/{server} asks; `servers` includes it),
cancelling a job run `servers` (as the jobs API), preempting `custom:gpulab:preempt`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from jupyterhub import orm
from jupyterhub.scopes import needs_scope
from jupyterhub.utils import isoformat, url_escape_path, url_path_join
from tornado import web

from gpulab.hub.allocator import Inventory, Placement
from gpulab.hub.allocator.model import MILLI
from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.cullservice import GPUCuller
from gpulab.hub.dask import parse_allocation_id
from gpulab.hub.jobservice.hub import GPUJobs
from gpulab.hub.jobservice.service import run_id_of
from gpulab.hub.ledger import MONITORED_WORKLOADS
from gpulab.hub.ledger.store import LiveFigure, figures_of_shares
from gpulab.hub.ledgerservice import GPULedger
from gpulab.hub.refusals import shown
from gpulab.hub.scopes import ADMIN_READ, PREEMPT

SERVER, JOB, DASK = "server", "job", "dask"
STOP, PREEMPT_ACTION = "stop", "preempt"
ACTIONS = (STOP, PREEMPT_ACTION)
#: one request acts on at most this many workloads (a page of the panel's table is far less)
MAX_IDS = 500
#: how long an action waits for a server to stop before answering that it is still stopping
STOP_WAIT_SECONDS = 60.0
#: JupyterHub's scope for stopping a server (its own DELETE of a server needs it)
STOP_SERVER_SCOPE = "delete:servers"
#: the jobs API's scope for cancelling a run (gpulab.hub.apihandlers.jobs)
CANCEL_JOB_SCOPE = "servers"


def workload_kind(allocation_id: str, server_allocations: Mapping[str, Any]) -> str:
    """What holds allocation `allocation_id`, from its id alone:

    - "server": a server JupyterHub has a record of holds it (`server_allocations`, each server
      spawner's own `allocation_id`: "{username}/{servername}" by default);
    - "dask": a Dask worker or scheduler, `<owner>/dask-<cluster>-w<n>` or
      `<owner>/dask-<cluster>-scheduler` (gpulab.hub.dask.parse_allocation_id);
    - "job": a job run's attempt, `<owner>/job-<run>` (gpulab.hub.jobservice.run_id_of);
    - otherwise "server": a server's allocation whose record JupyterHub no longer has (the
      hub's reconciliation releases those before the next spawn).

    A server's own record comes first, so a named server called "job-3" is still a server.
    """
    if allocation_id in server_allocations:
        return SERVER
    if parse_allocation_id(allocation_id) is not None:
        return DASK
    if run_id_of(allocation_id) is not None:
        return JOB
    return SERVER


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")


def _gpus_by_uuid(inventory: Inventory) -> dict[str, Any]:
    return {gpu.uuid: gpu for node in inventory.nodes for gpu in node.gpus}


@dataclass(frozen=True)
class ServerRecord:
    """What JupyterHub itself knows of a server that holds an allocation."""

    owner: str
    name: str
    url: str
    last_activity: datetime | None
    #: the profile its start asked for (JupyterHub's user_options); None: the catalog's default
    profile: str | None = None


def describe_workload(
    placement: Placement,
    kind: str,
    gpus: Mapping[str, Any],
    server: ServerRecord | None,
    now: datetime,
    events: list[dict[str, Any]] | None = None,
    figures: Mapping[str, LiveFigure] | None = None,
) -> dict[str, Any]:
    """One row of the panel: an allocation with its devices from the inventory, and for a server
    its UI-idle time from JupyterHub's own record (`last_activity`, naive UTC as JupyterHub
    stores it) and its live columns from `figures` (`live_columns`)."""
    request = placement.request
    devices = []
    for share in placement.gpus:
        gpu = gpus.get(share.uuid)
        devices.append(
            {
                "uuid": share.uuid,
                "index": gpu.index if gpu is not None else None,
                "model": gpu.model if gpu is not None else None,
                "mig_profile": gpu.mig_profile if gpu is not None else None,
                "milli": share.milli,
                "fraction": share.milli / MILLI,
            }
        )
    first = gpus.get(placement.gpus[0].uuid) if placement.gpus else None
    ui_idle = None
    if server is not None and server.last_activity is not None:
        ui_idle = max(0.0, (now - server.last_activity).total_seconds())
    return {
        "id": request.id,
        "kind": kind,
        "owner": request.owner,
        "groups": sorted(request.groups),
        # Request.profile arrives with the GPU-hour ledger; until then a server's own start says
        "profile": getattr(request, "profile", None) or (server.profile if server else None),
        "gpu_model": first.model if first is not None else None,
        "mig_profile": first.mig_profile if first is not None else None,
        "gpus": placement.gpu_milli / MILLI,
        "devices": devices,
        "node": placement.node,
        "tier": "preemptible" if request.preemptible else "on-demand",
        "over_quota": placement.over_quota,
        "started_at": _iso(placement.created_at),
        "server": (
            None
            if server is None
            else {
                "name": server.name,
                "url": server.url,
                "last_activity": isoformat(server.last_activity),
            }
        ),
        "ui_idle_seconds": ui_idle,
        # whether anything measures its GPU use: external pods push no figures, so their live
        # columns are null for that reason, not because their pushes went stale
        "monitored": kind in MONITORED_WORKLOADS,
        **live_columns(placement, figures or {}, now.replace(tzinfo=timezone.utc).timestamp()),
        "events": events or [],
    }


def live_columns(
    placement: Placement, figures: Mapping[str, LiveFigure], now: float
) -> dict[str, Any]:
    """The live columns of a workload from its slices' latest pushed figures (device uuid ->
    figure): mean utilisation, memory used, and GPU-idle = how long EVERY slice has stayed below
    the idle threshold (one busy or unknown slice: not idle). Null where a slice has no current
    figure (an external pod, which does not push; a workload whose pushes went stale)."""
    found = figures_of_shares([share.uuid for share in placement.gpus], figures)
    present = [f for f in found if f is not None]
    if not placement.gpus or len(present) != len(found):
        return {
            "utilization": None,
            "memory_used_mib": None,
            "gpu_idle_seconds": None,
            "live": None,
        }
    utils = [f.utilization_pct for f in present]
    known = [u for u in utils if u is not None]
    memory = [f.memory_used_mib for f in present if f.memory_used_mib is not None]
    since = [f.below_since for f in present]
    idle = None if any(b is None for b in since) else max(0.0, now - max(b for b in since if b))
    return {
        "utilization": sum(known) / len(known) if len(known) == len(utils) else None,
        "memory_used_mib": sum(memory) if memory else None,
        "gpu_idle_seconds": idle if idle is not None else 0.0 if len(known) == len(utils) else None,
        "live": {
            "age_seconds": max(0.0, now - min(f.t for f in present)),
            "idle_threshold_pct": present[0].idle_threshold_pct,
            "slices": [
                {
                    "device": f.device,
                    "utilization": f.utilization_pct,
                    "memory_used_mib": f.memory_used_mib,
                    "memory_limit_mib": f.memory_limit_mib,
                    "below_threshold_since": _iso(f.below_since),
                }
                for f in present
            ],
        },
    }


def describe_nodes(inventory: Inventory, placements: Iterable[Placement]) -> list[dict[str, Any]]:
    """Every node's GPUs with the shares placed on each (the panel's GPU map)."""
    shares: dict[str, list[dict[str, Any]]] = {}
    for placement in placements:
        for share in placement.gpus:
            shares.setdefault(share.uuid, []).append(
                {"id": placement.request.id, "owner": placement.request.owner, "milli": share.milli}
            )
    return [
        {
            "name": node.name,
            "gpus": [
                {
                    "uuid": gpu.uuid,
                    "index": gpu.index,
                    "model": gpu.model,
                    "mig_profile": gpu.mig_profile,
                    "memory_mib": gpu.memory_mib,
                    "capacity_milli": gpu.capacity_milli,
                    "shares": shares.get(gpu.uuid, []),
                }
                for gpu in node.gpus
            ],
        }
        for node in inventory.nodes
    ]


def parse_action(body: Any) -> tuple[str, list[str]]:
    """The action and the ids of a bulk-action body; 400 naming what is wrong, before anything
    is done."""
    if not isinstance(body, dict):
        raise web.HTTPError(400, 'The body must be a JSON object: {"action": "stop", "ids": [...]}')
    unknown = set(body) - {"action", "ids"}
    if unknown:
        raise web.HTTPError(400, f"Unknown field(s) {shown(sorted(unknown))}: send action and ids")
    action = body.get("action")
    if action not in ACTIONS:
        raise web.HTTPError(400, f"action: {shown(action)} is none of {', '.join(ACTIONS)}")
    ids = body.get("ids")
    if not isinstance(ids, list) or not ids:
        raise web.HTTPError(
            400, f"ids: expected a non-empty list of allocation ids, got {shown(ids)}"
        )
    if len(ids) > MAX_IDS:
        raise web.HTTPError(400, f"ids: {len(ids)} ids; at most {MAX_IDS} in one request")
    for item in ids:
        if not isinstance(item, str) or not item:
            raise web.HTTPError(400, f"ids: every id must be a non-empty string, got {shown(item)}")
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise web.HTTPError(400, f"ids: {shown(twice)} appears more than once")
    return str(action), list(ids)


#: a slice's figures older than this are stale (3 pushes at the default 15 s interval)
LIVE_MAX_AGE_SECONDS = 45.0


async def live_figures(handler: Any) -> dict[tuple[str, str], dict[str, LiveFigure]]:
    """(user, server name) -> device -> its latest figures, from the ledger's live table (which
    gpulab-metrics keeps current); empty when the ledger is off."""
    ledger = GPULedger.instance(config=handler.settings["config"], log=handler.log)
    if ledger.store is None:
        return {}
    newer_than = time.time() - LIVE_MAX_AGE_SECONDS
    rows = await asyncio.to_thread(ledger.store.live_figures, newer_than)
    out: dict[tuple[str, str], dict[str, LiveFigure]] = {}
    for f in rows:
        out.setdefault((f.user, f.server), {})[f.device] = f
    return out


class _AdminHandler(GPULabAPIHandler):
    def server_records(self) -> dict[str, tuple[Any, Any]]:
        """allocation id -> (hub user, spawner) of every server JupyterHub has running or
        starting. The id is the spawner's own (`allocation_id`, gpulab's spawners): the hub
        imports no spawner code, so it is read as an attribute, as the Dask service does."""
        out: dict[str, tuple[Any, Any]] = {}
        active = self.db.query(orm.Spawner).filter(orm.Spawner.server != None)  # noqa: E711
        for orm_spawner in active:
            user = self.users[orm_spawner.user]
            spawner = user.spawners[orm_spawner.name]
            allocation = getattr(spawner, "allocation_id", None)
            if allocation:
                out[str(allocation)] = (user, spawner)
        # a server still starting has placed its allocation but has no orm server yet
        for user in self.users.values():
            for spawner in list(user.spawners.values()):
                allocation = getattr(spawner, "allocation_id", None)
                if allocation and spawner.pending and str(allocation) not in out:
                    out[str(allocation)] = (user, spawner)
        return out

    @staticmethod
    def server_record(user: Any, spawner: Any) -> ServerRecord:
        return ServerRecord(
            owner=user.name,
            name=spawner.name,
            url=url_path_join(user.url, url_escape_path(spawner.name), "/"),
            last_activity=spawner.orm_spawner.last_activity,
            profile=_profile_of(spawner.user_options),
        )

    def caller_name(self) -> str:
        return str(getattr(self.current_user, "name", "") or "a service")


class AdminOverviewAPIHandler(_AdminHandler):
    """GET /hub/api/gpulab/admin/overview: {"generated_at", "inventory", "workloads", "nodes"}.

    One workload per allocation (see `workload_kind` for how servers, job runs and Dask workers
    are told apart, `describe_workload` for the fields). The live fields (`utilization`,
    `memory_used_mib`, `gpu_idle_seconds` and `live`) come from each server's latest push (via
    gpulab-metrics and the ledger's live table, at most LIVE_MAX_AGE_SECONDS old), or each job
    run's or Dask worker's report; null while none is current. Filtering is the panel's, client-side; `?owner=` and `?kind=`
    narrow the list for other callers."""

    @needs_scope(ADMIN_READ, "admin:users")
    async def get(self) -> None:
        capacity: GPUCapacity = self.gpu_capacity
        await capacity.ready()
        placements = capacity.allocator.allocations()
        servers = self.server_records()
        gpus = _gpus_by_uuid(capacity.inventory)
        now = datetime.now(timezone.utc).replace(tzinfo=None)  # JupyterHub stores naive UTC
        live = await live_figures(self)
        culler = GPUCuller.instance(config=self.settings["config"], log=self.log)
        owner_filter = self.get_argument("owner", "")
        kind_filter = self.get_argument("kind", "")
        workloads = []
        for placement in sorted(placements, key=lambda p: (p.request.owner, p.request.id)):
            kind = workload_kind(placement.request.id, servers)
            if owner_filter and placement.request.owner != owner_filter:
                continue
            if kind_filter and kind != kind_filter:
                continue
            held = servers.get(placement.request.id)
            record = self.server_record(*held) if kind == SERVER and held else None
            if record is not None:
                figures = live.get((record.owner, record.name), {})
            else:  # a job run or Dask worker reports as "<owner>/<workload name>"
                owner, _, name = placement.request.id.rpartition("/")
                figures = live.get((owner, name), {})
            events = capacity.events_for(placement.request.id)
            row = describe_workload(placement, kind, gpus, record, now, events, figures)
            if record is not None:  # GPU-aware culling's latest decision for this server
                row["culling"] = culler.decision_json(record.owner, record.name)
            workloads.append(row)
        self.write(
            {
                "generated_at": _iso(datetime.now(timezone.utc).timestamp()),
                "inventory": capacity.inventory_label,
                "workloads": workloads,
                "nodes": describe_nodes(capacity.inventory, placements),
            }
        )


class AdminActionsAPIHandler(_AdminHandler):
    """POST /hub/api/gpulab/admin/actions: {"action": "stop" | "preempt", "ids": [...]} ->
    {"action", "results": [{"id", "ok", "message"}, ...]} in the order of the ids.

    The whole body is checked first (400 naming what is wrong; nothing is done). Then each id on
    its own: an unknown id, a missing scope or an action that does not apply is that id's
    `ok: false` with a sentence, never a half-done stop. A stop returns once the server has
    stopped and given its GPU share back (or says it is still stopping after
    `STOP_WAIT_SECONDS`). Stopping a single Dask worker is not offered (its cluster would start
    a replacement): the message names the cluster's own API."""

    @needs_scope(ADMIN_READ, "admin:users")
    async def post(self) -> None:
        action, ids = parse_action(self.get_json_body())
        capacity = self.gpu_capacity
        await capacity.ready()
        servers = self.server_records()
        results = await asyncio.gather(*(self.act(action, i, servers) for i in ids))
        self.write({"action": action, "results": list(results)})

    async def act(
        self, action: str, allocation_id: str, servers: Mapping[str, tuple[Any, Any]]
    ) -> dict[str, Any]:
        placement = self.gpu_capacity.allocator.get(allocation_id)
        if placement is None:
            return _result(allocation_id, False, "No such allocation (released already?)")
        kind = workload_kind(allocation_id, servers)
        try:
            if action == STOP:
                message = await self.stop(placement, kind, servers.get(allocation_id))
            else:
                message = await self.preempt(placement, kind, servers.get(allocation_id))
        except ActionRefused as e:
            return _result(allocation_id, False, str(e))
        except Exception as e:  # one workload's failure is its answer, not the others'
            self.log.exception("admin panel: %s of %s failed", action, allocation_id)
            return _result(allocation_id, False, f"{action} failed: {e}")
        self.log.info(
            "admin panel: %s %s by %s: %s", action, allocation_id, self.caller_name(), message
        )
        return _result(allocation_id, True, message)

    # -- stop ----------------------------------------------------------------------------------

    async def stop(self, placement: Placement, kind: str, held: tuple[Any, Any] | None) -> str:
        if kind == SERVER:
            if held is None:
                raise ActionRefused("No running server holds this allocation")
            user, spawner = held
            if not self.get_scope_filter(STOP_SERVER_SCOPE)(spawner.orm_spawner, kind="server"):
                raise ActionRefused(
                    f"You lack the scope {STOP_SERVER_SCOPE!r} on {user.name}'s servers"
                )
            return await self.stop_server(placement, user, spawner)
        if kind == JOB:
            return await self.cancel_job(placement)
        cluster = parse_allocation_id(placement.request.id)
        where = f"/hub/api/gpulab/users/{placement.request.owner}/dask-clusters/"
        where += str(cluster.cluster_id) if cluster is not None else "{id}"
        raise ActionRefused(
            "Stopping one Dask worker is not supported yet (its cluster would start a "
            f"replacement); stop its cluster instead: DELETE {where}"
        )

    async def stop_server(self, placement: Placement, user: Any, spawner: Any) -> str:
        """Stop as JupyterHub's API does (`stop_single_user`: off the proxy, `user.stop(name)`),
        and wait until it has stopped."""
        what = f"server {spawner.name!r}" if spawner.name else "default server"
        label = f"{user.name}'s {what}"
        if spawner.pending:
            raise ActionRefused(
                f"{label} has a {spawner.pending} pending; try again once that is done"
            )
        if not spawner.active:
            raise ActionRefused(f"{label} is not running")
        future = await self.stop_single_user(user, spawner.name)
        try:
            await asyncio.wait_for(asyncio.shield(future), STOP_WAIT_SECONDS)
        except asyncio.TimeoutError:
            return f"Stopping {label}: still stopping after {STOP_WAIT_SECONDS:g} s"
        if self.gpu_capacity.allocator.get(placement.request.id) is not None:
            return f"Stopped {label}; its GPU share is not released yet"
        return f"Stopped {label}; its GPU share is free"

    async def cancel_job(self, placement: Placement) -> str:
        owner = placement.request.owner
        user = self.find_user(owner)
        may = self.get_scope_filter(CANCEL_JOB_SCOPE)
        if user is None or not may(user.orm_user, kind="user"):
            raise ActionRefused(f"You lack the scope {CANCEL_JOB_SCOPE!r} on user {owner}")
        service = GPUJobs.instance(config=self.settings["config"], log=self.log).service
        run_id = run_id_of(placement.request.id)
        if service is None or run_id is None:
            raise ActionRefused("GPU jobs are not running on this hub")
        run = await service.cancel(run_id, reason=f"stopped by {self.caller_name()} (admin panel)")
        return f"Canceled job run {run_id} of {owner} ({run.state.value}); its GPU share is free"

    # -- preempt -------------------------------------------------------------------------------

    async def preempt(self, placement: Placement, kind: str, held: tuple[Any, Any] | None) -> str:
        request = placement.request
        user = self.find_user(request.owner)
        may = self.get_scope_filter(PREEMPT)
        if user is None or not may(user.orm_user, kind="user"):
            raise ActionRefused(f"You lack the scope {PREEMPT!r} on user {request.owner}")
        if not request.preemptible:
            raise ActionRefused(
                f"{request.id} is on-demand: only preemptible (spot) workloads can be preempted; "
                "stop it instead"
            )
        capacity = self.gpu_capacity
        reason = f"preempted by {self.caller_name()} from the admin panel"
        if kind == SERVER:
            if held is None:
                raise ActionRefused("No running server holds this allocation")
            _user, spawner = held
            capacity.record_event(request.id, "preempted", reason)
            capacity.note_end_reason(request.id, "preempted")
            message = "Preempted: " + await self.stop_server(placement, *held)
            what = f"server {spawner.name!r}" if spawner.name else "default server"
        else:
            if not await capacity.evict(placement, reason):
                raise ActionRefused(f"Nothing on this hub can preempt {request.id}")
            # The evictor returns once nothing of it runs. A job run's own watcher gives its share
            # back (the run is queued again, maybe placed anew under the same id); a Dask worker's
            # stays held: release it, but only if it is still this placement.
            current = capacity.allocator.get(request.id)
            if current is not None and current.created_at == placement.created_at:
                await capacity.release(request.id)
            message = f"Preempted {request.id}; its GPU share is free"
            what = "job run" if kind == JOB else "Dask worker"
        capacity.record_notice(
            request.owner, f"Your preemptible {what} ({request.id}) was {reason}."
        )
        return message


class ActionRefused(Exception):
    """An action that does not apply to one workload; its message is that id's answer."""


def _profile_of(user_options: Any) -> str | None:
    profile = user_options.get("profile") if isinstance(user_options, dict) else None
    return profile if isinstance(profile, str) and profile else None


def _result(allocation_id: str, ok: bool, message: str) -> dict[str, Any]:
    return {"id": allocation_id, "ok": ok, "message": message}


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/api/gpulab/admin/overview", AdminOverviewAPIHandler),
    (r"/api/gpulab/admin/actions", AdminActionsAPIHandler),
]
