"""GPU jobs of a user: submit, list, read, cancel, and read an attempt's logs.

    GET    /hub/api/gpulab/users/{user}/jobs                 her runs, newest first
    POST   /hub/api/gpulab/users/{user}/jobs                 queue a run (201)
    GET    /hub/api/gpulab/users/{user}/jobs/{run}           one run, its attempts and outputs
    DELETE /hub/api/gpulab/users/{user}/jobs/{run}           cancel it (its GPU share is free on return)
    GET    /hub/api/gpulab/users/{user}/jobs/{run}/logs      ?stream=stdout|stderr&offset=N&attempt=K
    GET    /hub/api/gpulab/users/{user}/jobs/{run}/logs/stream   the same, live (Server-Sent Events)

Who may: JupyterHub's own scopes on the owner, as for her servers, since a job is a workload of
hers like a server: `read:servers` to read runs and logs, `servers` to submit and cancel (the
owner and admins hold both through JupyterHub's default roles; a role may grant them filtered by
user or group, e.g. to a CI service). A run is found only under its owner's name, so a caller
who may act on one user never reaches another's runs by id. The owner and groups of a run are the
hub's record of the user, never the request's; its spec is checked field by field (400 naming
the field), and a run that could never start is refused (400/403 naming why).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tornado import web
from tornado.iostream import StreamClosedError

from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.apihandlers.workspace_actions import scoped_user
from gpulab.hub.jobs import (
    RETRYABLE_STATES,
    IllegalTransition,
    JobNotFound,
    JobSpec,
    JobSpecError,
    Run,
    RunState,
)
from gpulab.hub.jobs.queue import queue_positions
from gpulab.hub.jobservice import JobRefused, JobService
from gpulab.hub.jobservice.hub import GPUJobs
from gpulab.hub.refusals import shown

READ, CHANGE = "read:servers", "servers"
#: spec fields the hub sets from its own record of the user
HUB_FIELDS = ("owner", "groups")


class _JobsHandler(GPULabAPIHandler):
    async def service(self) -> JobService:
        jobs = GPUJobs.instance(config=self.settings["config"], log=self.log)
        # right after the hub starts, the service is still recovering runs (on Kubernetes, after
        # the cluster's inventory synced): a request waits for it rather than being turned away
        await jobs.wait_started(timeout=30)
        if jobs.service is None:
            why = jobs.unavailable or "GPU jobs are starting; try again in a moment"
            raise web.HTTPError(503 if jobs.unavailable is None else 501, why)
        return jobs.service

    def owner(self, username: str, scope: str) -> Any:
        """The hub user `username`, when the request holds `scope` on her; else 403 (404 only
        for a caller who may act on every user)."""
        user, may = scoped_user(self, username, scope)
        if not may(user.orm_user, kind="user"):
            raise web.HTTPError(403, f"You lack the scope {scope!r} on user {shown(username)}")
        return user

    async def run_of(self, service: JobService, username: str, run_id: str) -> Run:
        run = None
        # digits only, and within the database's integer range (a longer one names no run)
        if run_id.isascii() and run_id.isdigit() and len(run_id) <= 18:
            try:
                run = await asyncio.to_thread(service.store.get_run, int(run_id))
            except JobNotFound:
                run = None
        if run is None or run.owner != username:
            raise web.HTTPError(404, f"{username} has no job run {shown(run_id)}")
        return run

    async def describe(self, service: JobService, run: Run, **extra: Any) -> dict[str, Any]:
        spec = await service.spec_of(run.job_id)
        model: dict[str, Any] = {
            "id": run.id,
            "job_id": run.job_id,
            "owner": run.owner,
            "spec": {k: v for k, v in spec.to_dict().items() if k not in HUB_FIELDS},
            "state": run.state.value,
            "reason": run.reason,
            # ended an attempt and will run again (its retry waits, e.g. a platform failure's
            # back-off): a client keeps it among the active runs
            "retrying": run.state in RETRYABLE_STATES and run.retry_allowed,
            "submitted_at": run.submitted_at,
            "updated_at": run.updated_at,
            "attempts": [
                {
                    "number": a.number,
                    "state": (a.outcome.value if a.outcome else run.state.value),
                    "node": a.placement.node,
                    "gpus": a.placement.describe(),
                    "admitted_at": a.admitted_at,
                    "started_at": a.started_at,
                    "ended_at": a.ended_at,
                    "exit_code": a.exit_code,
                    "reason": a.reason,
                    # failed before the job's code started: retried, not counted against
                    # max_retries (the first PLATFORM_RETRIES of a run)
                    "platform_failure": a.platform_failure,
                }
                for a in run.attempts
            ],
        }
        model.update(extra)
        return model


class JobsAPIHandler(_JobsHandler):
    async def get(self, username: str) -> None:
        self.owner(username, READ)
        service = await self.service()
        runs = await asyncio.to_thread(service.store.list_runs, owner=username)
        # positions count every queued run, not only hers: where she stands in the hub's queue
        queued = await asyncio.to_thread(service.store.list_runs, states={RunState.QUEUED})
        positions = queue_positions(queued)
        out = []
        for run in sorted(runs, key=lambda r: r.id, reverse=True):
            out.append(
                await self.describe(
                    service,
                    run,
                    queue_position=positions.get(run.id),
                    waiting_reason=service.waiting_reason(run),
                )
            )
        self.write({"runs": out})

    async def post(self, username: str) -> None:
        user = self.owner(username, CHANGE)
        service = await self.service()
        body = self.get_json_body() or {}
        if not isinstance(body, dict):
            raise web.HTTPError(400, "The body must be a JSON object (a job's fields)")
        for name in HUB_FIELDS:
            if name in body:
                raise web.HTTPError(400, f"{name}: set by the hub from the user, not the request")
        groups = sorted(g.name for g in user.groups)
        try:
            spec = JobSpec.from_dict({**body, "owner": username, "groups": groups})
            run = await service.submit(spec, is_admin=bool(user.admin))
        except JobSpecError as e:
            raise web.HTTPError(400, str(e)) from None
        except JobRefused as e:
            raise web.HTTPError(e.status, str(e)) from None
        self.set_status(201)
        self.write(
            await self.describe(
                service, run, queue_position=None, waiting_reason=service.waiting_reason(run)
            )
        )


class JobRunAPIHandler(_JobsHandler):
    async def get(self, username: str, run_id: str) -> None:
        self.owner(username, READ)
        service = await self.service()
        run = await self.run_of(service, username, run_id)
        outputs = await asyncio.to_thread(service.store.outputs, run.id)
        position = None
        if run.state is RunState.QUEUED:
            queued = await asyncio.to_thread(service.store.list_runs, states={RunState.QUEUED})
            position = queue_positions(queued).get(run.id)
        self.write(
            await self.describe(
                service,
                run,
                queue_position=position,
                waiting_reason=service.waiting_reason(run),
                outputs=[{"path": o.path, "size_bytes": o.size_bytes} for o in outputs],
            )
        )

    async def delete(self, username: str, run_id: str) -> None:
        self.owner(username, CHANGE)
        service = await self.service()
        run = await self.run_of(service, username, run_id)
        try:
            canceled = await service.cancel(run.id, reason=f"canceled by {self._caller()}")
        except IllegalTransition as e:
            raise web.HTTPError(409, e.reason) from None
        self.write(await self.describe(service, canceled))

    def _caller(self) -> str:
        return str(getattr(self.current_user, "name", "") or "a service")


class JobLogsAPIHandler(_JobsHandler):
    """The bytes of an attempt's log from `offset`, as text, with where to go on from: a client
    follows a running attempt by asking again from `next_offset`."""

    async def get(self, username: str, run_id: str) -> None:
        self.owner(username, READ)
        service = await self.service()
        run = await self.run_of(service, username, run_id)
        stream = _stream_argument(self)
        offset = _int_argument(self, "offset", 0)
        attempt = _int_argument(self, "attempt", len(run.attempts))
        if not 1 <= attempt <= len(run.attempts):
            raise web.HTTPError(404, f"run {run.id} has no attempt {attempt} (yet)")
        handle = await asyncio.to_thread(service.store.handle, run.id, attempt)
        if handle is None:
            data, next_offset = b"", offset
        else:
            data, next_offset = await service.executor.tail(handle, stream, offset)
        self.write(
            {
                "attempt": attempt,
                "stream": stream,
                "offset": offset,
                "next_offset": next_offset,
                "data": data.decode(errors="replace"),
                "ended": run.attempts[attempt - 1].ended_at is not None,
            }
        )


class JobLogStreamAPIHandler(_JobsHandler):
    """The run's log as Server-Sent Events (`EventSource` in a browser): every piece of the log
    as it is written, attempt after attempt, then an `end` event with the run's final state.
    Each piece carries the run's state as the store says when it is sent, so a client shows the
    state its log is in (the lab's badge said "queued" while the log streamed, until its next
    poll of the list); an attempt's log is streamed once the attempt has started (the run is
    running), never while the run is only admitted.

    Each event's id is `<attempt>:<offset>` after it; a stream ends after `STREAM_SECONDS` (so no
    connection is held for hours through proxies) and the client reconnects with
    `Last-Event-ID`, as EventSource does by itself, and continues exactly there."""

    STREAM_SECONDS = 20.0
    POLL_SECONDS = 0.25

    async def get(self, username: str, run_id: str) -> None:
        self.owner(username, READ)
        service = await self.service()
        run = await self.run_of(service, username, run_id)
        stream = _stream_argument(self)
        attempt, offset = self._resume_point()
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")  # a proxy in front must not buffer it
        deadline = asyncio.get_running_loop().time() + self.STREAM_SECONDS
        handle: dict[str, Any] | None = None
        handle_of = 0  # the attempt `handle` belongs to
        while True:
            if attempt == 0 and run.attempts:
                attempt = 1
            data = b""
            started = attempt and run.attempts[attempt - 1].started_at is not None
            if started and (handle is None or handle_of != attempt):
                handle = await asyncio.to_thread(service.store.handle, run.id, attempt)
                handle_of = attempt
            if handle is not None and handle_of == attempt:
                data, offset = await service.executor.tail(handle, stream, offset)
            if data:
                run = await asyncio.to_thread(service.store.get_run, run.id)
                piece = {"attempt": attempt, "data": data.decode(errors="replace")}
                body = json.dumps(piece | {"state": run.state.value})
                if not await self._send(f"id: {attempt}:{offset}\ndata: {body}\n\n"):
                    return
                continue
            ended = attempt and run.attempts[attempt - 1].ended_at is not None
            if ended and attempt < len(run.attempts):  # on to the next attempt's log
                attempt, offset = attempt + 1, 0
                continue
            if run.is_terminal and (ended or not run.attempts):
                end = json.dumps({"state": run.state.value, "reason": run.reason})
                await self._send(f"event: end\ndata: {end}\n\n")
                return
            if asyncio.get_running_loop().time() > deadline:
                return  # the client reconnects with Last-Event-ID
            await asyncio.sleep(self.POLL_SECONDS)
            run = await asyncio.to_thread(service.store.get_run, run.id)

    def _resume_point(self) -> tuple[int, int]:
        """(attempt, offset) from Last-Event-ID (a reconnect) or the query; (0, 0): the start."""
        last = self.request.headers.get("Last-Event-ID", "")
        if last:
            attempt, sep, offset = last.partition(":")
            if not (sep and attempt.isdigit() and offset.isdigit()) or len(last) > 40:
                raise web.HTTPError(400, f"Last-Event-ID: <attempt>:<offset>, not {shown(last)}")
            return int(attempt), int(offset)
        return _int_argument(self, "attempt", 0), _int_argument(self, "offset", 0)

    async def _send(self, text: str) -> bool:
        """False when the client has gone."""
        try:
            self.write(text)
            await self.flush()
        except StreamClosedError:
            return False
        return True


def _stream_argument(handler: Any) -> str:
    stream = str(handler.get_argument("stream", "stdout"))
    if stream not in ("stdout", "stderr"):
        raise web.HTTPError(400, f"stream: 'stdout' or 'stderr', not {shown(stream)}")
    return stream


def _int_argument(handler: Any, name: str, default: int) -> int:
    value = handler.get_argument(name, None)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise web.HTTPError(400, f"{name}: a whole number from 0, not {shown(value)}")
    return int(value)


_USER = r"/api/gpulab/users/([^/]+)/jobs"

default_handlers: list[tuple[str, type[Any]]] = [
    (_USER, JobsAPIHandler),
    (_USER + r"/([^/]+)", JobRunAPIHandler),
    (_USER + r"/([^/]+)/logs", JobLogsAPIHandler),
    (_USER + r"/([^/]+)/logs/stream", JobLogStreamAPIHandler),
]
