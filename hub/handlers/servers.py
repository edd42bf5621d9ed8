"""JupyterHub's server handlers with gpulab's checks in front, whatever the spawner.

- A new named server may not be called `default` (the default server's home) nor take a home
  another (renamed) server keeps: refused with a 400 before JupyterHub creates its record.
- A named server whose first start is refused (a 4xx from `apply_user_options` or `start`: unknown
  profile, quota, no capacity) leaves no record behind, so it does not count against
  `named_server_limit_per_user` and no listing (the admin page's included) shows it; a refusal
  that comes after JupyterHub answered (202, the pending page) removes it as soon as it comes. The default server's record stays: JupyterHub creates it for
  every user anyway (`user.spawner`) and the home page needs it.
- The spawn API's body is capped at `MAX_BODY_BYTES` (413) before JupyterHub parses it.
- A start through the API without options (an empty body, as VS Code's JupyterHub extension
  sends) gets a profile chosen on purpose (`start_options_for_empty_body`), never the options of
  the server's last start, which JupyterHub's `User.spawn` would load. Only where the spawner
  takes gpulab's profiles (`ChoosesGPULabProfiles`): a stock KubeSpawner would refuse a profile
  it does not list (a 500), and an upstream `profile_list` has a default of its own.

These subclasses are returned first by the hub's authenticator's `get_handlers`, whose routes
JupyterHub matches before its own: `gpulab.hub.config.apply(c)` extends whichever authenticator
class is configured with `GPULabHubHooks`, which does that.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from jupyterhub.apihandlers.users import SpawnProgressAPIHandler, UserServerAPIHandler
from jupyterhub.handlers.pages import SpawnHandler, SpawnPendingHandler
from jupyterhub.scopes import needs_scope
from tornado import web

from gpulab.hub.apihandlers import workspace_actions
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.refusals import check_body_size, is_expected_refusal


def forget_unstarted_server(handler: Any, user: Any, server_name: str) -> bool:
    """Delete the record of `user`'s named server `server_name` if it has never run and is not
    starting: the trace of a refused first start. Returns whether it did."""
    orm_spawner = user.orm_spawners.get(server_name) if server_name else None
    if orm_spawner is None or orm_spawner.server is not None:
        return False
    spawner = user.spawners[server_name]
    if spawner.active:
        return False
    # no delete_forever(): a refused first start created nothing outside the hub's database,
    # and a home left by an earlier server of that name is not this record's to remove
    user.spawners.pop(server_name, None)
    handler.db.delete(orm_spawner)
    handler.db.commit()
    handler.log.info("Removed %s/%s: its first start was refused", user.name, server_name)
    return True


#: how long a refusal's handler waits for JupyterHub to finish marking the start as ended
SETTLE_SECONDS = 5.0
SETTLE_POLL_SECONDS = 0.01


async def forget_refused_start(handler: Any, user: Any, server_name: str) -> bool:
    """`forget_unstarted_server` for a start that has just been refused. JupyterHub clears a
    start's pending flag in a done-callback of its spawn future, which runs on a later turn of
    the event loop than the one that hands the refusal to the handler (a start refused before
    its first await, e.g. over quota with `slow_spawn_timeout` 0): until then the server still
    counts as active and its record would stay. Waits (bounded) for that callback only: a start
    still under way is not waited for."""
    spawner = user.spawners.get(server_name) if server_name else None
    for _turn in range(int(SETTLE_SECONDS / SETTLE_POLL_SECONDS)):
        ending = (
            spawner is not None
            and spawner.pending
            and spawner._spawn_future is not None
            and spawner._spawn_future.done()
        )
        if not ending:
            break
        # JupyterHub's callback, not ours, ends the start: nothing to wait on but the loop
        await asyncio.sleep(SETTLE_POLL_SECONDS)
    return forget_unstarted_server(handler, user, server_name)


#: set on a Spawner whose record a gpulab handler created and that has not started since (in
#: memory: after a hub restart such a record is kept, as JupyterHub keeps it)
NEVER_STARTED = "gpulab_never_started"
#: set when such a server's start was refused after JupyterHub had answered (202, or the
#: pending page): its record goes once the person has been told why
REFUSED_FIRST_START = "gpulab_refused_first_start"


def is_first_start(user: Any, server_name: str) -> bool:
    """Whether a start of `user`'s named server would be its first: no record yet, or a record a
    gpulab handler made (a visit to its spawn form) that has never started."""
    if user is None or not server_name:
        return False
    if server_name not in user.orm_spawners:
        return True
    return bool(getattr(user.spawners[server_name], NEVER_STARTED, False))


#: why the latest first starts were refused in the background, by (user, server): their records
#: are gone by the time the person opens the pending page, which still says why
RECENT_REFUSALS: OrderedDict[tuple[str, str], tuple[int, str]] = OrderedDict()
RECENT_REFUSALS_KEPT = 256


def _remember_refusal(user_name: str, server_name: str, error: Any) -> None:
    key = (user_name, server_name)
    RECENT_REFUSALS.pop(key, None)
    RECENT_REFUSALS[key] = (int(error.status_code), str(error.log_message or error))
    while len(RECENT_REFUSALS) > RECENT_REFUSALS_KEPT:
        RECENT_REFUSALS.popitem(last=False)


def forgotten_refusal(user: Any, server_name: str) -> tuple[int, str] | None:
    """Why `user`'s named server `server_name` was refused, if its record is gone already."""
    if user is None or not server_name or server_name in user.orm_spawners:
        return None
    return RECENT_REFUSALS.get((user.name, server_name))


def _follow_first_start(handler: Any, user: Any, server_name: str) -> None:
    """A first start under way (or a form shown for one): remember that the record is new, and
    forget it as soon as its start, going on in the background, ends in a 4xx: a client that
    got 202 and the admin page then list nothing of it (a pending page or progress stream
    already open holds the spawner and still reports the refusal; one opened later reads
    RECENT_REFUSALS)."""
    if server_name not in user.orm_spawners:
        return
    spawner = user.spawners[server_name]
    setattr(spawner, NEVER_STARTED, True)
    future = spawner._spawn_future
    if future is None:  # only the form was shown
        return

    def ended(done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            return
        if is_expected_refusal(done.exception()):
            setattr(spawner, REFUSED_FIRST_START, True)
            _remember_refusal(user.name, server_name, done.exception())
            # handler.db is the hub's one session and handler.log its logger: both outlive
            # the request that started this
            task = asyncio.ensure_future(forget_refused_start(handler, user, server_name))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)
        elif done.exception() is None:
            setattr(spawner, NEVER_STARTED, False)

    future.add_done_callback(ended)  # also when it has ended already (then it runs next)


#: forgetting tasks under way (the loop keeps only weak references to tasks)
_BACKGROUND: set[asyncio.Future[Any]] = set()


def _forget_refused_servers(handler: Any, user: Any) -> None:
    for name in [n for n in user.orm_spawners if n]:
        spawner = user.spawners[name]
        if getattr(spawner, REFUSED_FIRST_START, False) and not spawner.active:
            forget_unstarted_server(handler, user, name)


def start_options_for_empty_body(
    capacity: GPUCapacity, groups: frozenset[str], is_admin: bool, server_name: str
) -> tuple[dict[str, str], str]:
    """The options of a start that names none, and why: for a named server called like a
    profile the user may use, that profile (the named-server convention: an IDE that cannot send
    options picks `gpu-a100` by starting the server `gpu-a100`); otherwise her default profile
    (`GPUCapacity.default_profile`). Empty options when she may use no profile (the spawner then
    refuses the start with the reason)."""
    if server_name:
        named = capacity.profile(server_name)
        if named is not None and named in capacity.visible_profiles(groups, is_admin):
            return {"profile": named.slug}, "the server's name"
    default = capacity.default_profile(groups, is_admin)
    if default is None:
        return {}, "no profile is available"
    return {"profile": default.slug}, "the default profile"


@runtime_checkable
class ChoosesGPULabProfiles(Protocol):
    """A spawner class whose starts take one of gpulab's profiles (`GPUCapacity.profiles`):
    every gpulab spawner says so here (the hub imports no spawner code). Any other spawner class,
    such as a stock KubeSpawner hub that loads gpulab's config, gets a start's options as
    JupyterHub passes them."""

    @classmethod
    def chooses_gpulab_profiles(cls, config: Any) -> bool:
        """Whether, with the hub's `config`, a start of this class takes a gpulab profile (a
        Kubernetes spawner with an upstream `profile_list` does not)."""


def takes_gpulab_profiles(spawner_class: Any, config: Any) -> bool:
    """Whether the hub's `JupyterHub.spawner_class` starts servers with gpulab's profiles."""
    return isinstance(spawner_class, ChoosesGPULabProfiles) and bool(
        spawner_class.chooses_gpulab_profiles(config)
    )


class _ServerChecks:
    """The checks both the REST API and the spawn pages share (mixed into their handlers)."""

    async def _check_named_server_request(
        self, user: Any, server_name: str, display_name: str, check_limit: bool = True
    ) -> None:
        _forget_refused_servers(self, user)
        if server_name not in user.orm_spawners:
            args = self.path_args  # type: ignore[attr-defined]
            renaming = self.request.method == "PATCH" and len(args) > 1  # type: ignore[attr-defined]
            renamed_from = args[1] if renaming else None
            workspace_actions.check_new_server_name(user, server_name, renamed_from)
        await super()._check_named_server_request(  # type: ignore[misc]
            user, server_name, display_name, check_limit
        )


class GPULabUserServerAPIHandler(_ServerChecks, UserServerAPIHandler):
    """/hub/api/users/{user}/server[s/{name}] with gpulab's checks."""

    async def prepare(self) -> None:
        check_body_size(self)
        await super().prepare()

    def get_server_json_body(self) -> dict[str, Any]:
        body: dict[str, Any] = super().get_server_json_body()
        if self.request.method != "POST" or body.get("user_options") is not None:
            return body
        if not takes_gpulab_profiles(self.settings["spawner_class"], self.settings["config"]):
            return body  # JupyterHub's own behaviour: not gpulab's spawner, nor its profiles
        user = self.find_user(self.path_args[0]) if self.path_args else None
        if user is None:
            return body  # JupyterHub answers 404
        server_name = self.path_args[1] if len(self.path_args) > 1 else ""
        groups = frozenset(g.name for g in user.groups)
        capacity = GPUCapacity.instance(config=self.settings["config"], log=self.log)
        options, why = start_options_for_empty_body(capacity, groups, user.admin, server_name)
        self.log.info(
            "Start of %s/%s without options: profile %r (%s)",
            user.name,
            server_name,
            options.get("profile"),
            why,
        )
        body["user_options"] = options
        return body

    async def post(self, user_name: str, server_name: str = "") -> None:
        user = self.find_user(user_name)
        first = is_first_start(user, server_name)
        try:
            await super().post(user_name, server_name)
        except web.HTTPError as e:
            if first and is_expected_refusal(e):
                await forget_refused_start(self, user, server_name)
            raise
        if first:
            _follow_first_start(self, user, server_name)

    async def patch(self, user_name: str, server_name: str = "") -> None:
        body = self.get_json_body() if not server_name else None
        if isinstance(body, dict) and body.get("name"):
            # JupyterHub would create a new default server next to the renamed one, and both
            # would use the home 'default'
            raise web.HTTPError(
                400,
                "The default server cannot be renamed: its home stays the default server's; "
                "clone a snapshot of it into a new named server instead",
            )
        await super().patch(user_name, server_name)


class GPULabSpawnHandler(_ServerChecks, SpawnHandler):
    """/hub/spawn[/{user}[/{name}]] (the spawn form) with gpulab's checks. A refused start
    renders the form again with the reason (JupyterHub's own behaviour); its record goes."""

    async def prepare(self) -> None:
        if self.request.method == "POST":
            check_body_size(self)
        await super().prepare()

    async def _forgetting_refusals(
        self, user_name: str, server_name: str, start: Callable[[], Awaitable[Any]]
    ) -> Any:
        user = self.find_user(user_name or self.current_user.name)
        first = is_first_start(user, server_name)
        try:
            result = await start()
        except web.HTTPError as e:
            if first and is_expected_refusal(e):
                await forget_refused_start(self, user, server_name)
            raise
        if first and server_name in user.orm_spawners:
            if 400 <= self.get_status() < 500:  # the form came back with the reason
                await forget_refused_start(self, user, server_name)
            else:  # the form for a new server, or its start going on behind the pending page
                _follow_first_start(self, user, server_name)
        return result

    async def _get(self, user_name: str, server_name: str, display_name: str) -> Any:
        start = functools.partial(
            super()._get, user_name=user_name, server_name=server_name, display_name=display_name
        )
        return await self._forgetting_refusals(user_name, server_name, start)

    async def _post(self, user_name: str, server_name: str, display_name: str) -> Any:
        start = functools.partial(
            super()._post, user_name=user_name, server_name=server_name, display_name=display_name
        )
        return await self._forgetting_refusals(user_name, server_name, start)


class GPULabSpawnPendingHandler(SpawnPendingHandler):
    """/hub/spawn-pending/{user}/{name}: shows why a first start was refused, then drops the
    server's record (it never ran)."""

    async def get(self, user_name: str, server_name: str = "") -> None:
        user = self.find_user(user_name)
        try:
            # JupyterHub's checks first: only who may see this server's page reads its refusal
            await super().get(user_name, server_name)
        except web.HTTPError as e:
            refused = forgotten_refusal(user, server_name)
            if e.status_code != 404 or refused is None:
                raise
            status, message = refused
            raise web.HTTPError(status, message) from None  # its record is gone already
        spawner = user.spawners[server_name] if user and server_name in user.spawners else None
        if spawner is not None and getattr(spawner, REFUSED_FIRST_START, False):
            await forget_refused_start(self, user, server_name)


class GPULabSpawnProgressAPIHandler(SpawnProgressAPIHandler):
    """/hub/api/users/{user}/servers/{name}/progress (the pending page's event stream): a stream
    opened after a refused first start's record went (the pending page was shown while the start
    ran, the refusal and the forgetting came before its script connected) gets the refusal as
    its failed event, where JupyterHub would answer 404 and leave the page saying "starting"
    for ever. Only for a caller whose scopes may read that user's servers (`read:servers`,
    checked first, as JupyterHub's own handler does): another tenant gets the same 404 as for a
    server that never existed, and learns nothing of the refusal."""

    @needs_scope("read:servers")
    async def get(self, user_name: str, server_name: str = "") -> None:
        refused = forgotten_refusal(self.find_user(user_name), server_name or "")
        if refused is None:
            await super().get(user_name, server_name)
            return
        self.set_header("Cache-Control", "no-cache")
        _status, message = refused
        await self.send_event(
            {"progress": 100, "failed": True, "message": f"Spawn failed: {message}"}
        )


#: routes ahead of JupyterHub's own (relative to the hub's prefix, as get_handlers returns them)
server_handler_overrides: list[tuple[str, type[Any]]] = [
    (r"/api/users/([^/]+)/server", GPULabUserServerAPIHandler),
    (r"/api/users/([^/]+)/servers/([^/]*)", GPULabUserServerAPIHandler),
    (r"/api/users/([^/]+)/server/progress", GPULabSpawnProgressAPIHandler),
    (r"/api/users/([^/]+)/servers/([^/]*)/progress", GPULabSpawnProgressAPIHandler),
    (r"/spawn", GPULabSpawnHandler),
    (r"/spawn/([^/]+)", GPULabSpawnHandler),
    (r"/spawn/([^/]+)/([^/]+)", GPULabSpawnHandler),
    (r"/spawn-pending/([^/]+)", GPULabSpawnPendingHandler),
    (r"/spawn-pending/([^/]+)/([^/]+)", GPULabSpawnPendingHandler),
]
