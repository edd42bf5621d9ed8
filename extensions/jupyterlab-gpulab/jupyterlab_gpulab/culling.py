"""GPU-aware culling's side in the server: what a person did here, which kernels are busy, and the
hub's warning for JupyterLab to show.

The frontend (src/culling/) POSTs each kind of REAL input it sees to `gpulab/culling/input`
(keys and clicks in the lab's shell, cells run, terminal input), at most every few seconds. The
server keeps the time of the latest of each kind and, every `report_interval_seconds` (the hub
names it in each answer), reports them as ages together with its kernels' execution states
(jupyter_server's kernel manager tracks `execution_state` from each kernel's status messages) to
the hub's POST /hub/api/gpulab/users/<user>/[servers/<server>/]activity, with this server's own
$JUPYTERHUB_API_TOKEN. The hub answers with the warning to show (or none): the frontend polls
`gpulab/culling` for it.

Why the server pushes: the hub would otherwise need a credential that reaches every server, while
this server's own token is worth only its owner's access (`users:activity!user`: it can report
for her servers, nobody else's). What it reports can only keep her servers from being culled,
never make one culled sooner (gpulab.hub.cullservice.reports): no power beyond a busy loop.

Nothing else counts as input: the GPU panel's polling and websocket, this module's own GET, API
calls of widgets. Those handlers never call `record_input`, so an abandoned lab with only the GPU
panel open is culled. The report goes straight to the hub's API URL, never through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from typing import Any, cast
from urllib.parse import quote

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from gpulab.hub.culling import USER_INPUT_KINDS
from gpulab.spawner.names import (
    ACTIVITY_REPORT_PATH,
    DEFAULT_ACTIVITY_REPORT_INTERVAL_SECONDS,
    SWITCH_TO_CPU_PATH,
)

log = logging.getLogger(__name__)

NAMESPACE = "gpulab/culling"
#: the hub's cadence is taken within these bounds (a broken answer cannot make a server spin)
MIN_INTERVAL_SECONDS, MAX_INTERVAL_SECONDS = 0.5, 300.0
TIMEOUT_SECONDS = 10.0


class ActivityReporter:
    """Keeps the latest input of each kind and reports it with the busy kernels to the hub."""

    def __init__(self, kernel_manager: Any, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self.kernel_manager = kernel_manager
        api_url = env.get("JUPYTERHUB_API_URL", "")
        user, server = env.get("JUPYTERHUB_USER", ""), env.get("JUPYTERHUB_SERVER_NAME", "")
        self.token = env.get("JUPYTERHUB_API_TOKEN", "")
        #: "" outside a hub: input is still kept, nothing is reported
        self.base = ""
        if api_url and user and self.token:
            path = f"gpulab/users/{quote(user, safe='')}"
            if server:
                path += f"/servers/{quote(server, safe='')}"
            self.base = url_path_join(api_url, path)
        self.interval = DEFAULT_ACTIVITY_REPORT_INTERVAL_SECONDS
        #: kind -> time.monotonic() of the latest input of that kind
        self.last_input: dict[str, float] = {}
        #: the hub's latest answer, and when it came (monotonic)
        self.answer: dict[str, Any] = {}
        self.answered_at: float | None = None
        self.error = ""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- input ---------------------------------------------------------------------------------

    def record_input(self, kind: str) -> bool:
        """A person's input of `kind` now; False for a kind that is no input."""
        if kind not in USER_INPUT_KINDS:
            return False
        self.last_input[kind] = time.monotonic()
        if self.warning() is not None:
            self._wake.set()  # she is back: tell the hub now, so the warning goes at once
        return True

    def busy_kernels(self) -> tuple[int, int]:
        """(busy, all) kernels, from the kernel manager's execution states."""
        ids = list(self.kernel_manager.list_kernel_ids())
        busy = 0
        for kernel_id in ids:
            try:
                state = self.kernel_manager.get_kernel(kernel_id).execution_state
            except KeyError:  # shut down meanwhile
                continue
            busy += state == "busy"
        return busy, len(ids)

    def report(self, keep_alive: bool = False) -> dict[str, Any]:
        now = time.monotonic()
        busy, kernels = self.busy_kernels()
        body: dict[str, Any] = {
            "input_seconds_ago": {k: round(now - t, 3) for k, t in self.last_input.items()},
            "busy_kernels": busy,
            "kernels": kernels,
        }
        if keep_alive:
            body["keep_alive"] = True
        return body

    # -- the hub -------------------------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        response = await AsyncHTTPClient().fetch(
            HTTPRequest(
                url_path_join(self.base, path),
                method="POST",
                body=json.dumps(body),
                headers={"Authorization": f"token {self.token}"},
                connect_timeout=TIMEOUT_SECONDS,
                request_timeout=TIMEOUT_SECONDS,
                follow_redirects=False,  # the token goes to the hub only
            ),
            raise_error=False,
        )
        try:
            answer = json.loads(response.body or b"{}")
        except ValueError:
            answer = {}
        if response.code == 599:
            answer = {"message": f"no answer from the hub: {response.error}"}
        return response.code, answer if isinstance(answer, dict) else {}

    async def push(self, keep_alive: bool = False) -> dict[str, Any]:
        """Report now; the hub's answer (also kept for `warning()`)."""
        if not self.base:
            return {}
        code, answer = await self._post(ACTIVITY_REPORT_PATH, self.report(keep_alive))
        if code != 200:
            error = f"HTTP {code}: {str(answer.get('message', ''))[:200]}"
            if error != self.error:  # once per outage
                log.warning("gpulab culling: reporting activity to the hub failed: %s", error)
            self.error = error
            raise web.HTTPError(502, f"The hub refused the report ({error})")
        self.error = ""
        self.answer, self.answered_at = answer, time.monotonic()
        interval = answer.get("report_interval_seconds")
        if isinstance(interval, int | float) and not isinstance(interval, bool):
            self.interval = min(MAX_INTERVAL_SECONDS, max(MIN_INTERVAL_SECONDS, float(interval)))
        return answer

    async def switch_to_cpu(self) -> tuple[int, dict[str, Any]]:
        if not self.base:
            return 501, {"message": "This server does not run under a JupyterHub"}
        return await self._post(SWITCH_TO_CPU_PATH, {})

    def warning(self) -> dict[str, Any] | None:
        """The hub's current warning, its seconds left counted down since it answered."""
        warning = self.answer.get("warning")
        if not isinstance(warning, dict) or self.answered_at is None:
            return None
        left = float(warning.get("seconds_left", 0.0)) - (time.monotonic() - self.answered_at)
        return {**warning, "seconds_left": max(0.0, left)}

    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        latest = max(self.last_input.values(), default=None)
        return {
            "reporting": bool(self.base),
            "culling": bool(self.answer.get("culling", False)),
            "warning": self.warning(),
            # the hub's word on the user's GPU-hour budget (past its warning share, or used up)
            "budget_notice": self.answer.get("budget_notice") or None,
            "poll_seconds": self.interval,
            "last_input_seconds_ago": None if latest is None else round(now - latest, 3),
            "error": self.error or None,
        }

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.base and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.push()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the hub restarting, a timeout: the next period tries again
                if not self.error:
                    log.warning("gpulab culling: reporting activity failed: %s", e)
                self.error = self.error or str(e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)


class _CullingHandler(APIHandler):
    @property
    def reporter(self) -> ActivityReporter:
        return cast(ActivityReporter, self.settings["gpulab_culling"])

    def write_json(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(body))


class CullingStateHandler(_CullingHandler):
    """GET: {"reporting", "culling", "warning", "poll_seconds", "last_input_seconds_ago"}. The
    frontend's polling: no activity (neither here nor for JupyterHub's idle culler)."""

    _track_activity = False

    @web.authenticated
    def get(self) -> None:
        self.write_json(self.reporter.state())


class InputHandler(_CullingHandler):
    """POST {"kind": "ui-input" | "kernel-execute" | "terminal-input"}: a person did that now."""

    @web.authenticated
    def post(self) -> None:
        try:
            kind = json.loads(self.request.body or b"{}").get("kind")
        except (ValueError, AttributeError):
            kind = None
        if not isinstance(kind, str) or not self.reporter.record_input(kind):
            kinds = ", ".join(sorted(USER_INPUT_KINDS))
            self.write_json({"message": f"kind: send one of {kinds}"}, 400)
            return
        self.set_status(204)
        self.finish()


class KeepAliveHandler(_CullingHandler):
    """POST: the user's "Keep alive"; the hub's answer (the warning is gone from it)."""

    @web.authenticated
    async def post(self) -> None:
        self.reporter.record_input("ui-input")  # a click on the button is input too
        if not self.reporter.base:
            self.write_json({"message": "This server does not run under a JupyterHub"}, 501)
            return
        self.write_json(self.state_after(await self.reporter.push(keep_alive=True)))

    def state_after(self, answer: dict[str, Any]) -> dict[str, Any]:
        return {**self.reporter.state(), "keep_alive_until": answer.get("keep_alive_until")}


class SwitchToCPUHandler(_CullingHandler):
    """POST: the user's "Switch to CPU": the hub restarts this server on its CPU-only profile."""

    @web.authenticated
    async def post(self) -> None:
        code, answer = await self.reporter.switch_to_cpu()
        self.write_json(answer, code if code != 599 else 502)


def setup_culling(web_app: Any, kernel_manager: Any) -> ActivityReporter:
    reporter = ActivityReporter(kernel_manager)
    web_app.settings["gpulab_culling"] = reporter
    base = url_path_join(web_app.settings["base_url"], NAMESPACE)
    routes: list[tuple[str, type]] = [
        ("", CullingStateHandler),
        ("input", InputHandler),
        ("keep-alive", KeepAliveHandler),
        ("switch-to-cpu", SwitchToCPUHandler),
    ]
    web_app.add_handlers(".*$", [(url_path_join(base, path), cls) for path, cls in routes])
    return reporter
