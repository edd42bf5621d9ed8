"""The GPU jobs panel's API under <base_url>gpulab/jobs/: the owner's runs from the hub, as the
panel needs them, and their live logs.

Why a server-side hop: the browser holds no token for the hub's REST API (the lab page is
authenticated to this server by its own OAuth cookie, which the hub's API does not take), and
giving the page one would put a hub token in JavaScript. So the page asks this server, which
asks the hub with its own token (`hubjobs`: scoped to this server's owner only); whoever reaches
this server is its owner or someone JupyterHub let in with `access:servers` on it.

    GET    gpulab/jobs                       her runs, newest first, with the panel's extras
    POST   gpulab/jobs                       submit a file of this server's (201, the run)
    GET    gpulab/jobs/profiles              her GPU profiles, what is free, her quota
    GET    gpulab/jobs/<run>                 one run, with its outputs as paths in this server
    DELETE gpulab/jobs/<run>                 cancel it
    POST   gpulab/jobs/<run>/rerun           submit the same spec again (201, the new run)
    GET    gpulab/jobs/<run>/logs/stream     the hub's Server-Sent Events, passed through

None of these count as activity of the server (`_track_activity = False`): watching a job is not
using the server, and the idle culler may stop it while the job runs on.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import urlencode

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.iostream import StreamClosedError

from . import jobmapping
from .hubjobs import HubError, HubJobs, HubUnavailable

NAMESPACE = "gpulab/jobs"
#: where the TensorBoard of this server reads runs from (jupyter-server-proxy, `tensorboard.py`)
TENSORBOARD_PATH = "tensorboard/"


class _JobsHandler(APIHandler):
    _track_activity = False

    def hub(self) -> HubJobs:
        try:
            return HubJobs.from_env()
        except HubUnavailable as e:
            raise web.HTTPError(501, str(e)) from None

    def extras(self, run: dict[str, Any]) -> dict[str, Any]:
        root, home = self.settings["server_root_dir"], _home()
        spec = run["spec"]
        tensorboard = ""
        if str(spec["output_dir"]).startswith("gpulab-jobs/"):
            run_dir = f"{str(spec['output_dir']).removeprefix('gpulab-jobs/')}/run-{run['id']}"
            # TensorBoard's run selector takes a regular expression in `runFilter`
            pattern = "^" + _regex_escape(run_dir) + "(/|$)"
            tensorboard = (
                url_path_join(self.base_url, TENSORBOARD_PATH)
                + "?"
                + _query({"runFilter": pattern})
                + "#timeseries"
            )
        return {
            **run,
            "status_message": jobmapping.status_message(run),
            "output_paths": jobmapping.output_paths(run, root, home),
            "tensorboard_url": tensorboard,
        }

    def answer(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(body))

    def refused(self, e: HubError) -> web.HTTPError:
        return web.HTTPError(e.status if 400 <= e.status < 600 else 502, e.message)


class RunsHandler(_JobsHandler):
    @web.authenticated
    async def get(self) -> None:
        try:
            runs = await self.hub().runs()
        except HubError as e:
            raise self.refused(e) from None
        self.answer({"runs": [self.extras(r) for r in runs]})

    @web.authenticated
    async def post(self) -> None:
        """Submit a file of this server's: `{"path", "profile", "args"?, "name"?, "parameters"?}`
        (the lab's "Submit as GPU job" for scripts, which jupyter-scheduler's form does not take)."""
        try:
            request = json.loads(self.request.body or b"{}")
        except ValueError:
            request = None
        if not isinstance(request, dict):
            raise web.HTTPError(
                400, 'The body must be a JSON object: {"path": ..., "profile": ...}'
            )
        for name in ("path", "profile"):
            if not isinstance(request.get(name), str) or not request[name]:
                raise web.HTTPError(400, f"{name}: is required (a string)")
        create = {
            "input_uri": request["path"],
            "name": request.get("name") or "",
            "compute_type": request["profile"],
            "parameters": None,
        }
        try:
            body = jobmapping.submit_body(
                create,
                root_dir=self.settings["server_root_dir"],
                home=_home(),
                profiles=[request["profile"]],
            )
        except jobmapping.MappingError as e:
            raise web.HTTPError(400, str(e).replace("input_uri", "path", 1)) from None
        for name in ("args", "parameters"):
            if name in request:
                body[name] = request[name]  # the hub checks them field by field
        try:
            run = await self.hub().submit(body)
        except HubError as e:
            raise self.refused(e) from None
        self.answer(self.extras(run), 201)


class ProfilesHandler(_JobsHandler):
    """The owner's GPU profiles with what is free now, her quota, and why a job or a Dask
    cluster of each would be refused now (the hub's capacity, the spawn picker's numbers)."""

    @web.authenticated
    async def get(self) -> None:
        try:
            capacity = await self.hub().capacity()
        except HubError as e:
            raise self.refused(e) from None
        self.answer(
            {
                "quota": capacity.get("quota"),
                "profiles": [
                    {
                        "slug": p["slug"],
                        "label": jobmapping.compute_type_label(p, None),
                        "gpu": jobmapping.has_gpu(p),
                        # what Submit would be refused for now ('' for nothing): the dialogs
                        # disable the profile with it, as the spawn picker does
                        "refused": {
                            "job": str((p.get("refused") or {}).get("job") or ""),
                            "dask": str((p.get("refused") or {}).get("dask") or ""),
                        },
                    }
                    for p in capacity["profiles"]
                ],
            }
        )


class RunHandler(_JobsHandler):
    @web.authenticated
    async def get(self, run_id: str) -> None:
        try:
            run = await self.hub().run(int(run_id))
        except HubError as e:
            raise self.refused(e) from None
        self.answer(self.extras(run))

    @web.authenticated
    async def delete(self, run_id: str) -> None:
        try:
            run = await self.hub().cancel(int(run_id))
        except HubError as e:
            raise self.refused(e) from None
        self.answer(self.extras(run))


class RerunHandler(_JobsHandler):
    @web.authenticated
    async def post(self, run_id: str) -> None:
        hub = self.hub()
        try:
            old = await hub.run(int(run_id))
            run = await hub.submit(old["spec"])  # the hub sets owner and groups again
        except HubError as e:
            raise self.refused(e) from None
        self.answer(self.extras(run), 201)


class LogStreamHandler(_JobsHandler):
    """The hub's event stream, chunk by chunk; `Last-Event-ID` goes on to the hub, so the
    browser's EventSource resumes exactly where it was when the hub ends a stream."""

    @web.authenticated
    async def get(self, run_id: str) -> None:
        stream = self.get_argument("stream", "stdout")
        if stream not in ("stdout", "stderr"):
            raise web.HTTPError(400, f"stream: 'stdout' or 'stderr', not {stream[:40]!r}")
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        gone = False

        def relay(chunk: bytes) -> None:
            nonlocal gone
            if gone:
                return
            try:
                self.write(chunk)
                self.flush()
            except StreamClosedError:
                gone = True

        try:
            await self.hub().stream_logs(
                int(run_id), relay, stream, self.request.headers.get("Last-Event-ID", "")
            )
        except HubError as e:
            if not self._headers_written:
                raise self.refused(e) from None
        if not gone:
            self.finish()


def _home() -> str:
    """The owner's home, where the hub runs her jobs (this server runs as her, HOME is hers)."""
    return os.path.expanduser("~")


def _query(values: dict[str, str]) -> str:
    return urlencode(values)


def _regex_escape(text: str) -> str:
    """`text` as a literal in a JavaScript regular expression (Python's re.escape also escapes
    '-', which a JavaScript pattern with the `u` flag refuses)."""
    return re.sub(r"([.*+?^${}()|\[\]\\/])", r"\\\1", text)


def setup_job_handlers(web_app: Any) -> None:
    base = url_path_join(web_app.settings["base_url"], NAMESPACE)
    routes: list[tuple[str, type]] = [
        ("", RunsHandler),
        ("profiles", ProfilesHandler),
        (r"(\d{1,18})", RunHandler),
        (r"(\d{1,18})/rerun", RerunHandler),
        (r"(\d{1,18})/logs/stream", LogStreamHandler),
    ]
    web_app.add_handlers(".*$", [(url_path_join(base, path), cls) for path, cls in routes])
