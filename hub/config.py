"""The one config function: `apply(c)` makes any JupyterHub a gpulab hub, whatever its authenticator.

The embedded default (`hub/jupyterhub_config.py`) and a cluster deployment (a z2jh-style config
with OAuthenticator, say) both end with::

    from gpulab.hub.config import apply
    apply(c)

It must come LAST in the config file, after every setting it reads (the authenticator class, the
GPU profiles and quotas), and it registers:

- gpulab's REST endpoints (`/hub/api/gpulab/...`, `gpulab.hub.apihandlers`) and pages
  (`/hub/gpulab/workspaces`, `gpulab.hub.handlers`) as `c.JupyterHub.extra_handlers`, its
  templates (hub/templates) on `c.JupyterHub.template_paths` after an admin's own, and its custom
  scopes (`custom:gpulab:...`, `gpulab.hub.scopes`) in `c.JupyterHub.custom_scopes`, so that
  roles may grant them;
- gpulab's checks in front of JupyterHub's own server handlers (reserved names, bounded bodies, no
  record left by a refused first start). JupyterHub routes an authenticator's handlers first, its
  own next and extra handlers last (`JupyterHub.init_handlers`), so these can only come first
  through the authenticator: the configured class is extended with `GPULabHubHooks`, which also
  makes expected refusals one log line and checks the GPU configuration when the hub starts (a
  mistake stops the hub with a message naming the option, before anyone spawns);
- the hub services gpulab runs beside the hub, each with a role that holds only what it needs: the
  idle culler (`GPULab.cull_idle_seconds`) and `gpulab-metrics` (`GPULab.metrics_*`), and where
  every server pushes its GPU figures (`c.Spawner.environment`).

Its own options are the traits of `GPULab` (``c.GPULab.cull_idle_seconds = 1800``). The
environment variables `gpulab run` reads (GPULAB_CULL_IDLE_SECONDS, GPULAB_METRICS_*) are only
conveniences that the shipped config turns into these traits.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from jupyterhub.app import JupyterHub
from jupyterhub.auth import Authenticator
from traitlets import Bool, Enum, Float, Integer, TraitError, Unicode, validate
from traitlets.config import Config, Configurable
from traitlets.utils.importstring import import_item

from gpulab.hub import apihandlers, handlers
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.culling import CullConfigError
from gpulab.hub.cullservice import GPUCuller
from gpulab.hub.daskservice.hub import GPUDask, post_stop_hook
from gpulab.hub.handlers.servers import server_handler_overrides
from gpulab.hub.inventory import InventoryError
from gpulab.hub.jobservice.hub import GPUJobs
from gpulab.hub.ledgerservice import GPULedger
from gpulab.hub.profiles import ProfileError
from gpulab.hub.refusals import install_quiet_refusals
from gpulab.hub.scopes import ALLOCATIONS_READ, CUSTOM_SCOPES, DASK, REPORT_GPU, USAGE
from gpulab.hub.warmpool import WARM_POOL_OWNER, PoolConfigError
from gpulab.hub.warmpoolservice import GPUWarmPool
from gpulab.spawner.names import (
    DEFAULT_PUSH_INTERVAL_SECONDS,
    LEDGER_DB_URL_ENV,
    METRICS_CONFIG_ENV,
    MONITOR_SOURCE_ENV,
    PUSH_INTERVAL_ENV,
    PUSH_PATH,
    PUSH_URL_ENV,
)

#: JupyterHub's own default when a config names no authenticator
DEFAULT_AUTHENTICATOR = "pam"
#: gpulab's HTML templates (its pages, the picker, the approval page)
TEMPLATES = Path(__file__).parent / "templates"
#: $JUPYTERHUB_API_TOKEN of every server: JupyterHub's `server` role (reach this one server,
#: report its activity) plus the scopes of the hub's GPU jobs API on the server's owner alone
#: (`!user` becomes `!user=<owner>`), so the lab's jobs panel and jupyter-scheduler's gpulab
#: backend can list, submit and cancel her runs. It is worth no more than her own access (JupyterHub
#: grants a server token only the part of these its owner holds) and reaches no other tenant: the
#: filter names her, and the token lives in her server's environment under her account
#: (tests/hub/jobservice/test_lab_backend.py: another user's server token gets 403 on her runs).
SERVER_TOKEN_SCOPES = [
    "access:servers!server",
    "users:activity!user",
    "read:servers!user",
    "servers!user",
    # her Dask clusters (gpulab.dask.GPUCluster in a notebook), hers alone (the same filter)
    f"{DASK}!user",
    # her GPU-hours and budget left (the lab's GPU panel), hers alone (the same filter)
    f"{USAGE}!user",
]
#: every route apply(c) adds after JupyterHub's own (relative to the hub's prefix): REST, pages
gpulab_handlers: list[tuple[str, type[Any]]] = [
    *apihandlers.default_handlers,
    *handlers.default_handlers,
]


@runtime_checkable
class ChecksHubStart(Protocol):
    """A spawner class with conditions the machine must meet before any server can start
    (optional capability): the hub refuses to start while one is not met."""

    @classmethod
    def hub_start_problems(cls, config: Any) -> list[str]:
        """What is wrong, each with its fix (empty: nothing)."""
        ...


class GPULabHubHooks(Authenticator):
    """What gpulab needs from the hub's authenticator, for any authenticator class.

    `apply(c)` puts this in front of the configured class (`GPULabAuthenticator` has it already):
    the server checks go before JupyterHub's own routes, a refused spawn is one log line, and the
    GPU configuration is loaded at hub start.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # the hub's logger (spawners and handlers log there): a refused spawn is one line
        install_quiet_refusals(self.log)
        self.check_gpu_configuration()
        self.check_spawner_prerequisites()
        self.attach_job_service()

    def validate_username(self, username: str) -> bool:
        """JupyterHub's check, and never the warm pool's own account (its reservations' owner in
        the allocator and the ledger): no person may log in as it and take its quota or GPUs."""
        return username != WARM_POOL_OWNER and bool(super().validate_username(username))

    def attach_job_service(self) -> None:
        """GPU jobs and Dask clusters for this hub (`GPUJobs`, `GPUDask`): the authenticator is made while the hub
        initialises, in its event loop, with the hub as its parent; an authenticator made
        anywhere else (a test, a config check) starts nothing."""
        app = self.parent
        if not isinstance(app, JupyterHub):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        GPUJobs.instance(config=self.config, log=self.log).attach_to_hub(app)
        GPUDask.instance(config=self.config, log=self.log).attach_to_hub(app)
        GPULedger.instance(config=self.config, log=self.log).attach_to_hub(app)
        GPUCuller.instance(config=self.config, log=self.log).attach_to_hub(app)
        GPUWarmPool.instance(config=self.config, log=self.log).attach_to_hub(app)

    def check_gpu_configuration(self) -> None:
        """Load the GPU inventory, catalog and quotas at hub start, so that a configuration
        mistake stops the hub with a message naming the option instead of failing the first
        spawn."""
        try:
            capacity = GPUCapacity.instance(config=self.config, log=self.log)
            # the culling policy names profiles: checked against this catalog
            culler = GPUCuller.instance(config=self.config, log=self.log)
            if culler.enabled:
                culler.load_policy([p.slug for p in capacity.catalog])
            # the warm pools name profiles too
            GPUWarmPool.instance(config=self.config, log=self.log).load_pools(capacity)
        except (
            ProfileError,
            InventoryError,
            TraitError,
            CullConfigError,
            PoolConfigError,
            ValueError,
        ) as e:
            self.log.critical("gpulab configuration error: %s", e)
            raise SystemExit(1) from None

    def check_spawner_prerequisites(self) -> None:
        """The hub's spawner class's conditions (`ChecksHubStart`), checked at hub start: a
        machine where no server could start stops the hub with the reason and the fix, instead
        of failing every start (an authenticator made outside a hub checks nothing)."""
        app = self.parent
        if not isinstance(app, JupyterHub) or not isinstance(app.spawner_class, ChecksHubStart):
            return
        problems = app.spawner_class.hub_start_problems(self.config)
        for problem in problems:
            self.log.critical("gpulab configuration error: %s", problem)
        if problems:
            raise SystemExit(1)

    def get_handlers(self, app: Any) -> list[Any]:
        return server_handler_overrides + list(super().get_handlers(app))


def authenticator_class(configured: Any) -> type[Authenticator]:
    """The class a `JupyterHub.authenticator_class` value names: a class, an entry point name of
    `jupyterhub.authenticators` ("dummy", "pam", "github"...) or a dotted import path."""
    if isinstance(configured, type):
        return configured
    name = str(configured or DEFAULT_AUTHENTICATOR)
    for ep in entry_points(group="jupyterhub.authenticators"):
        if ep.name == name:
            return ep.load()  # type: ignore[no-any-return]
    if "." not in name:
        raise ValueError(
            f"JupyterHub.authenticator_class {name!r} is neither an installed authenticator's "
            "entry point name nor a dotted class path"
        )
    return import_item(name)  # type: ignore[no-any-return]


def with_hub_hooks(cls: type[Authenticator]) -> type[Authenticator]:
    """`cls` with `GPULabHubHooks` in front, or `cls` itself when it has them already. The new
    class keeps `cls`'s name, so `c.<ClassName>.option` settings and its log lines read the same."""
    if issubclass(cls, GPULabHubHooks):
        return cls
    return type(cls.__name__, (GPULabHubHooks, cls), {"__module__": cls.__module__})


MONITOR_SOURCES = ("auto", "nvml", "simulated", "none")


class GPULab(Configurable):
    """gpulab's hub-wide options: the services it runs beside the hub, and what every server's
    GPU monitor shows."""

    monitor_source = Enum(
        MONITOR_SOURCES,
        "auto",
        config=True,
        help="""Where every server's GPU monitor takes its figures: 'auto' (NVML where the driver
        answers; where the server's GPUs come from a declared inventory or a dev-cluster node,
        simulated figures labelled SIMULATED, shaped like the GPU the hub placed it on; else
        none), 'nvml', 'simulated' or 'none'. A CPU-only server shows no GPU whatever this says.
        Reaches servers as GPULAB_MONITOR_SOURCE (c.Spawner.environment).""",
    )

    cull_idle_seconds = Integer(
        3600,
        config=True,
        help="""Stop servers without activity for this many seconds, so that idle servers give
        their GPUs back (JupyterHub's idle culler, run as the hub service 'idle-culler' with
        only the scopes it needs). 0: no culling.""",
    )
    metrics_service = Bool(
        True,
        config=True,
        help="""Run the hub service 'gpulab-metrics': every server pushes its GPU figures to it,
        it evaluates the admins' alert rules and serves /services/gpulab-metrics/{metrics,
        api/servers,api/alerts} to admins. Its role reads which servers run and nothing more (no
        access:servers, no proxy): it never calls a server.""",
    )
    metrics_service_url = Unicode(
        "",
        config=True,
        help="""Where gpulab-metrics listens, e.g. 'http://127.0.0.1:8002'. Empty: a free loopback
        port chosen at hub start (several hubs can share a machine).""",
    )
    metrics_push_url = Unicode(
        "",
        config=True,
        help="""The address servers push their figures to, when they reach the service by
        another name than metrics_service_url (Kubernetes pods: the hub's in-cluster address).
        Empty: metrics_service_url + '/api/push'. Pushes go straight to the service, never
        through the proxy, so pushing is no activity that would keep a server from culling.""",
    )
    metrics_push_interval_seconds = Float(
        DEFAULT_PUSH_INTERVAL_SECONDS,
        config=True,
        help="How often every server pushes its GPU figures to gpulab-metrics, in seconds.",
    )
    metrics_config_file = Unicode(
        "",
        config=True,
        help="""A config file for gpulab-metrics (c.MetricsService.rules and its other options).
        Empty: its defaults.""",
    )
    ide_token_expires_in_seconds = Integer(
        7 * 24 * 3600,
        config=True,
        help="""How long a token made on /hub/gpulab/ide (for VS Code's JupyterHub extension)
        stays valid, in seconds (default 7 days). Such a token holds only its user's own
        servers (start, stop, reach); the user makes a new one when it expires.""",
    )

    @validate("ide_token_expires_in_seconds")
    def _check_ide_token_expiry(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if value <= 0:
            raise TraitError(
                f"GPULab.ide_token_expires_in_seconds must be > 0 (an IDE token always "
                f"expires), got {value}"
            )
        return value


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _add_service(c: Config, service: dict[str, Any], scopes: list[str]) -> None:
    """A hub service and a role of its own holding exactly `scopes` (appended: an admin's and a
    test's services stay)."""
    name = service["name"]
    role = {"name": name, "scopes": scopes, "services": [name]}
    for key, entry in (("services", service), ("load_roles", role)):
        current = c.JupyterHub.get(key, [])
        if isinstance(current, list):  # assigned: replace an entry of the same name, if any
            c.JupyterHub[key] = [e for e in current if e.get("name") != name] + [entry]
        else:  # c.JupyterHub.services.append(...) without an assignment: traitlets' lazy list
            current.append(entry)


def add_services(c: Config, settings: GPULab) -> None:
    """The idle culler and gpulab-metrics as `settings` says, and where servers push."""
    if settings.cull_idle_seconds > 0:
        seconds = settings.cull_idle_seconds
        command = [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={seconds}"]
        command.append(f"--cull-every={max(1, min(300, seconds // 2))}")
        _add_service(
            c,
            {"name": "idle-culler", "command": command},
            ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        )
    if not settings.metrics_service:
        return
    url = settings.metrics_service_url or f"http://127.0.0.1:{_free_loopback_port()}"
    interval = f"{settings.metrics_push_interval_seconds:g}"
    environment = {PUSH_INTERVAL_ENV: interval}
    if settings.metrics_config_file:
        environment[METRICS_CONFIG_ENV] = settings.metrics_config_file
    ledger = GPULedger(config=c)
    if ledger.enabled:
        # the service adds the GPU-seconds each server's monitor saw used to the ledger; the
        # URL (and a PostgreSQL password in it) is in this hub-side process's environment only,
        # never a server's
        environment[LEDGER_DB_URL_ENV] = ledger.absolute_db_url
    service = {
        "name": "gpulab-metrics",
        "url": url,
        "command": [sys.executable, "-m", "gpulab.hub.services.metrics"],
        "environment": environment,
        "oauth_no_confirm": True,
        "display": False,
    }
    # which servers run and which job runs and Dask workers hold a GPU (to refuse pushes for
    # others and forget stopped ones); nothing that reaches a server (no access:servers) and no
    # proxy: it never calls a server
    _add_service(c, service, ["list:users", "read:users", "read:servers", ALLOCATIONS_READ])
    # Where each server pushes, and how often; neither is a secret: a push carries the server's
    # own token, worth only that server.
    push_url = settings.metrics_push_url or f"{url.rstrip('/')}/{PUSH_PATH.strip('/')}"
    # .update(): merged into a dict the admin assigned, or recorded to merge into the default
    c.Spawner.environment.update({PUSH_URL_ENV: push_url, PUSH_INTERVAL_ENV: interval})


def add_web(c: Config) -> None:
    """gpulab's routes, templates and scopes, after whatever the admin's config set (each call
    adds nothing twice)."""
    extra = list(c.JupyterHub.get("extra_handlers", []))
    routes = {route for route, *_ in extra}
    c.JupyterHub.extra_handlers = extra + [h for h in gpulab_handlers if h[0] not in routes]
    # after an admin's own paths, so that a deployment may restyle gpulab's pages too
    paths = [str(p) for p in c.JupyterHub.get("template_paths", [])]
    if str(TEMPLATES) not in paths:
        c.JupyterHub.template_paths = [*paths, str(TEMPLATES)]
    # copies: JupyterHub defines them again at start, and an identical definition is no conflict
    scopes = dict(c.JupyterHub.get("custom_scopes", {}))
    scopes.update({name: dict(spec) for name, spec in CUSTOM_SCOPES.items()})
    c.JupyterHub.custom_scopes = scopes


def add_dask(c: Config) -> None:
    """Dask clusters: every user manages her own (`custom:gpulab:dask!user` in the `user` role,
    which a server token then may hold too), and a stopped server stops its clusters that are not
    kept alive (`Spawner.post_stop_hook`, after an admin's own hook)."""
    extra = list(c.JupyterHub.get("extra_user_scopes", []))
    # her own GPU-hours too (GET /hub/api/gpulab/users/{her}/usage): `!user` reaches no other
    # and reports of her own workloads' GPU figures, which the hub narrows to one workload per
    # token it issues (gpulab.hub.report_tokens): no server token holds it
    missing = [s for s in (f"{DASK}!user", f"{USAGE}!user", f"{REPORT_GPU}!user") if s not in extra]
    if missing:
        c.JupyterHub.extra_user_scopes = [*extra, *missing]
    admins_hook = c.Spawner.get("post_stop_hook")
    if admins_hook is None or admins_hook is post_stop_hook:
        c.Spawner.post_stop_hook = post_stop_hook
    elif not getattr(admins_hook, "gpulab_dask", False):

        async def both(spawner: Any) -> None:
            result = admins_hook(spawner)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result
            await post_stop_hook(spawner)

        both.gpulab_dask = True  # type: ignore[attr-defined]
        c.Spawner.post_stop_hook = both


def apply(c: Config) -> None:
    """Make the hub configured in `c` a gpulab hub (see the module docstring). Call it last."""
    settings = GPULab(config=c)
    add_services(c, settings)
    # every server's monitor, whatever the spawner (an admin's own entry wins)
    env = c.Spawner.environment
    # a LazyConfigValue (.update() without assignment) caches what get_value returns: ask a copy
    current = env if isinstance(env, dict) else copy.deepcopy(env).get_value({})
    if MONITOR_SOURCE_ENV not in current:
        env.update({MONITOR_SOURCE_ENV: settings.monitor_source})
    if "server_token_scopes" not in c.Spawner:  # an admin's own choice wins
        c.Spawner.server_token_scopes = list(SERVER_TOKEN_SCOPES)
    add_dask(c)
    # VS Code's traffic through a route of its own that is no activity (an admin's proxy wins)
    if "proxy_class" not in c.JupyterHub:
        c.JupyterHub.proxy_class = "gpulab.hub.proxy.GPULabProxy"
    configured = c.JupyterHub.get("authenticator_class", DEFAULT_AUTHENTICATOR)
    c.JupyterHub.authenticator_class = with_hub_hooks(authenticator_class(configured))
    add_web(c)


__all__ = [
    "ChecksHubStart",
    "GPULab",
    "GPULabHubHooks",
    "apply",
    "authenticator_class",
    "gpulab_handlers",
    "with_hub_hooks",
]
