"""gpulab's local spawners: JupyterHub's local-process spawners plus GPU profiles and allocation.

`GPUSimpleLocalSpawner`, the embedded default, keeps a home per user and server under the hub's
directory and runs each user's servers as a system account the hub makes for that user
(`gpulab.spawner.local.accounts`); `GPULocalSpawner` runs each server as the user's existing system
account (LocalProcessSpawner). Only a hub that is not root (it cannot switch users) runs every
server as its own account, and then it says so on every page and lets one user at a time in.
"""

from __future__ import annotations

import os
import pwd
import sys
from typing import Any, ClassVar

from jupyterhub.spawner import LocalProcessSpawner, set_user_setuid
from tornado import web
from traitlets import Bool, Enum, Float, Integer, TraitError, Tuple, Unicode, default, validate
from traitlets.config import Config

from gpulab.hub.state_dir import unreachable_message
from gpulab.spawner.environment import (
    AssignedGPU,
    Enforcement,
    enforcement_for,
    gpu_environment,
    with_caps_hook,
)
from gpulab.spawner.gpu_mixin import GPUSpawnerMixin
from gpulab.spawner.local.accounts import (
    AccountCreationFailed,
    AccountError,
    SystemAccount,
    account_name,
    check_account,
    ensure_account,
)
from gpulab.spawner.local.early_exit import StartReport, wait_ready_or_exit
from gpulab.spawner.local.executors import LocalExecutorsMixin
from gpulab.spawner.local.warm_start import LocalWarmStartMixin
from gpulab.spawner.local.watchdog import (
    GPUMemoryWatchdog,
    NvmlProcessMemory,
    ProcessMemorySource,
    SimulatedProcessMemory,
)
from gpulab.spawner.names import CAPS_HOOK_ENV, PROFILE_ENV
from gpulab.spawner.workspaces.local import LocalWorkspaceMixin


# warm starts and the job and Dask executors are parts of their own (warm_start, executors); they
# come after LocalWorkspaceMixin, the first base, so that the options each class lists as its own
# (docs/configuration.md) stay where they were, and before GPUSpawnerMixin, which they build on
class GPULocalSpawnerMixin(
    LocalWorkspaceMixin, LocalWarmStartMixin, LocalExecutorsMixin, GPUSpawnerMixin
):
    """Applies a placement to a local process: device visibility, MPS or framework caps, and the
    memory watchdog."""

    mps_pipe_directory = Unicode(
        "",
        config=True,
        help="""CUDA_MPS_PIPE_DIRECTORY of a running MPS control daemon
        (`nvidia-cuda-mps-control -d`). When set, fractional GPU shares are enforced by MPS
        (memory and SM limits set by the driver); otherwise by framework caps (cooperative).""",
    )
    mps_log_directory = Unicode("", config=True, help="CUDA_MPS_LOG_DIRECTORY of the MPS daemon.")

    watchdog_interval_seconds = Float(
        5.0, config=True, help="How often the GPU memory watchdog samples per-process memory."
    )
    watchdog_grace_seconds = Float(
        60.0,
        config=True,
        help="""How long a server may stay over its GPU share after the watchdog warned before it is
        stopped (its GPU share is then released).""",
    )
    simulated_gpu_processes_file = Unicode(
        "",
        config=True,
        help="""SIMULATED GPU process memory for machines without a GPU (tests and demos): a JSON
        file {gpu_uuid: {pid: MiB}} the watchdog reads instead of NVML. Leave empty in production.""",
    )

    _watchdogs: ClassVar[dict[tuple[str, float, float], GPUMemoryWatchdog]] = {}

    @default("options_form")
    def _default_options_form(self) -> Any:
        return self.gpulab_options_form

    def describe_enforcement(self, gpus: list[AssignedGPU]) -> Enforcement:
        return enforcement_for(gpus, mps_available=bool(self.mps_pipe_directory))

    # -- watchdog ------------------------------------------------------------------------------

    def _memory_source(self) -> ProcessMemorySource:
        if self.simulated_gpu_processes_file:
            return SimulatedProcessMemory(self.simulated_gpu_processes_file)
        return NvmlProcessMemory()

    @property
    def watchdog(self) -> GPUMemoryWatchdog:
        key = (
            self.simulated_gpu_processes_file,
            self.watchdog_interval_seconds,
            self.watchdog_grace_seconds,
        )
        if key not in self._watchdogs:
            self._watchdogs[key] = GPUMemoryWatchdog(
                self._memory_source(),
                interval_seconds=self.watchdog_interval_seconds,
                grace_seconds=self.watchdog_grace_seconds,
                log=self.log,
            )
        return self._watchdogs[key]

    def _start_watchdog(self) -> None:
        """Watch every server: a fraction's memory cap, and for whole-GPU and CPU-only servers
        that they use no GPU but their own (any other GPU counts as a 0 MiB share)."""
        if not self.pid:
            return
        if self.gpu_capacity.inventory_is_declared and not self.simulated_gpu_processes_file:
            return  # no driver, nothing to sample
        placement = self.gpulab_placement
        gpus = self.assigned_gpus(placement) if placement is not None else []
        limits = {g.uuid: g.memory_limit_mib for g in gpus}
        self.watchdog.watch(self.allocation_id, self.pid, limits, self._on_over_share)

    async def _on_over_share(self, stage: str, message: str) -> None:
        self.gpu_capacity.record_event(self.allocation_id, stage, message)
        if stage == "stop":
            await self.stop()

    # -- whose process: the server's account -------------------------------------------------

    #: resolved at the first start or workspace operation (a pwd look-up, or useradd)
    _server_account: SystemAccount | None = None

    def server_runs_as_hub(self) -> bool:
        """True when servers run as the hub's own account (no OS boundary between users)."""
        return False

    def lookup_server_account(self) -> SystemAccount:
        """The existing account this user's servers run as; KeyError when there is none yet."""
        return SystemAccount.from_pwd(pwd.getpwnam(self.user.name))

    async def create_server_account(self) -> SystemAccount:
        """Make the account when missing (backends that provision accounts override this)."""
        try:
            return self.lookup_server_account()
        except KeyError:
            raise web.HTTPError(
                403, f"User {self.user.name!r} has no system account on this machine"
            ) from None

    async def workspace_account(self, create: bool = False) -> SystemAccount | None:
        if self.server_runs_as_hub():
            return None
        if self._server_account is None:
            if create:
                self._server_account = await self.create_server_account()
            else:
                try:
                    self._server_account = self.lookup_server_account()
                except KeyError:
                    raise LookupError(f"{self.user.name} has no system account yet") from None
        return self._server_account

    def check_server_accounts(self) -> None:
        """Refuse a start that the account settings do not allow (backends override)."""

    def make_preexec_fn(self, name: str) -> Any:
        if self.server_runs_as_hub():  # the hub's own account: only move into the user's directory
            start_dir = str(self._user_dirs()[0])

            def preexec() -> None:
                os.chdir(start_dir)

            return preexec
        account = self._server_account
        if account is None:  # never fall back to the hub's account (root) for user code
            raise RuntimeError(f"no system account resolved for {self.user.name} before its start")
        return set_user_setuid(account.name)  # uid, gid, groups; starts in the account's home

    def user_env(self, env: dict[str, str]) -> dict[str, str]:
        account = self._server_account
        env["USER"] = account.name if account else self.user.name
        env["HOME"] = str(self.workspace_home_dir())
        env["SHELL"] = "/bin/bash"
        return env

    async def _start_process(self) -> Any:
        """LocalProcessSpawner's start with the server's command behind gpulab's prepare step,
        which makes and prepares the home as the server's own account, then execs the server;
        returns once the server answers, and fails with the reason when it exits before
        (`gpulab.spawner.local.early_exit`)."""
        original, original_popen = list(self.cmd), self.popen_kwargs
        home = str(self.workspace_home_dir())
        report = StartReport()
        prepare = [
            sys.executable,
            "-m",
            "gpulab.spawner.singleuser.checkpoint.prepare",
            "--home",
            home,
            f"--report-fd={report.write_fd}",
        ]
        if not self.checkpoints:
            prepare.append("--directory-only")
        self.cmd = [*prepare, "--", *original]
        passed = (*original_popen.get("pass_fds", ()), report.write_fd)
        self.popen_kwargs = {**original_popen, "pass_fds": passed}
        try:
            ip, port = await super().start()  # type: ignore[misc]
            report.close_write_end()
            if self.internal_ssl:  # JupyterHub's own wait, with its certificates
                return (ip, port)
            url = f"http://{ip}:{port}{self.server.base_url}api"
            name = f"{self.user.name}'s server" + (f" {self.name!r}" if self.name else "")
            await wait_ready_or_exit(
                self.proc, url, name=name, report=report, timeout=self.http_timeout
            )
            return (ip, port)
        finally:
            self.cmd, self.popen_kwargs = original, original_popen
            report.close()

    # -- spawner lifecycle ---------------------------------------------------------------------

    def get_env(self) -> dict[str, str]:
        env = super().get_env()
        env.update(self.workspace_env(env))
        placement = self.gpulab_placement
        gpus = self.assigned_gpus(placement) if placement else []
        gpu_env, enforcement = gpu_environment(
            gpus,
            mps_pipe_directory=self.mps_pipe_directory,
            mps_log_directory=self.mps_log_directory,
        )
        env.update(gpu_env)
        if placement is not None and placement.gpus:
            env.update(self.inventory_environment(placement))
        if gpu_env.get(CAPS_HOOK_ENV):
            env["PYTHONPATH"] = with_caps_hook(env.get("PYTHONPATH"))
        if self.gpulab_profile is not None:
            env[PROFILE_ENV] = self.gpulab_profile.slug
        self.gpulab_enforcement = enforcement
        return env

    async def start(self) -> Any:
        # apply_user_options resolved it already; resolve again when called outside a hub spawn
        profile = self.gpulab_profile or self.resolve_profile(self.user_options)
        self.gpulab_profile = profile
        if profile.mem_limit_mib:
            self.mem_limit = profile.mem_limit_mib * 1024 * 1024
        if profile.cpu_limit:
            self.cpu_limit = profile.cpu_limit
        self.check_server_accounts()
        await self.apply_workspace_options()
        member = await self._claim_warm(profile)
        if member is None:
            await self.gpulab_allocate(profile)
        try:
            await self.prepare_workspace(self.workspace_home_dir())
            url = await self._bind_warm(member, profile) if member is not None else None
            if url is None:
                url = await self._start_process()
        except BaseException:
            await self.gpulab_release()
            raise
        finally:
            self.workspace_auto_restore = False  # once, for this start
        self._start_watchdog()
        self.start_snapshot_schedule()
        return url

    async def stop(self, now: bool = False) -> None:
        self.stop_snapshot_schedule()
        try:
            await super().stop(now=now)
        finally:
            self.watchdog.unwatch(self.allocation_id)
            await self.gpulab_release()
        await self.snapshot_workspace()

    def get_args(self) -> list[str]:
        return [*super().get_args(), *self.workspace_args()]

    async def poll(self) -> int | None:
        had_process = bool(self.pid)
        status = await super().poll()
        if status is not None and had_process:
            # crashed or exited by itself: JupyterHub will not call stop() for a server that is
            # already gone, so its share is released here
            self.watchdog.unwatch(self.allocation_id)
            self.stop_snapshot_schedule()
            await self.gpulab_release()
            if not self._stop_pending:  # a stop takes its own snapshot once the process is gone
                # lost rather than shut down (crash, OOM kill, reboot): the next start restores
                # the kernels' last checkpoints without asking, as after a preemption
                self.workspace_auto_restore = self.checkpoints and status != 0
                await self.snapshot_workspace("after-exit")
        elif status is None and not self.watchdog.is_watching(self.allocation_id):
            # resumed after a hub restart: pick up the persisted placement and watch it again
            if self.gpulab_placement is None:
                self.restore_placement()
            self._start_watchdog()
            if not self.snapshot_schedule_running:
                self.start_snapshot_schedule()
        return status

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        if self.gpulab_placement is not None:
            state["gpulab_allocation"] = self.allocation_id
        if self.gpulab_profile is not None:
            state["gpulab_profile"] = self.gpulab_profile.slug
        state.update(self.workspace_state())
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        if state.get("gpulab_allocation"):
            self.restore_placement()
        slug = state.get("gpulab_profile")
        if slug:
            self.gpulab_profile = self.gpu_capacity.profile(slug)
        self.load_workspace_state(state)

    def clear_state(self) -> None:
        super().clear_state()
        self.gpulab_profile = None
        # workspace_name and workspace_auto_restore stay: the workspace outlives the process

    async def progress(self) -> Any:
        async for event in self.gpulab_progress():
            yield event


class GPULocalSpawner(GPULocalSpawnerMixin, LocalProcessSpawner):
    """Each server runs as its user's existing system account (same name as the hub user), with
    a whole or fractional GPU and a workspace in the account's home."""


def _default_server_accounts() -> str:
    return "per-user" if os.geteuid() == 0 else "hub"


class GPUSimpleLocalSpawner(GPULocalSpawnerMixin, LocalProcessSpawner):
    """The embedded default: a home directory per user and server under the hub's directory, each
    user's servers running as a system account the hub makes for that user on first spawn. A hub
    that is not root runs every server as its own account instead: no isolation between users,
    said on every page, one user at a time unless an admin allows more."""

    home_dir_template = Unicode(
        config=True,
        help="""Where each server's home (its persistent volume) lives. {username} is the user's
        name, {servername} the server's name ('default' for the default server), so that a named
        server, or a clone of a workspace, has a home of its own. The directory that holds a
        user's homes belongs to the user's account (0700); the one above it must be the hub's.
        Default: homes/{username}/{servername} under the hub's directory.""",
    )
    home_dir = Unicode(help="The home directory of this server (from home_dir_template)")

    server_accounts = Enum(
        ["per-user", "hub"],
        config=True,
        help="""Which OS account servers run as. 'per-user' (the default when the hub runs as
        root): one unprivileged system account per hub user, made on the user's first spawn
        (see system_account_prefix and system_account_uid_range); homes, snapshots and
        checkpoint keys are that account's, so users cannot read each other's files, tokens or
        processes. 'hub' (the default otherwise): every server runs as the hub's own account and
        users are NOT isolated from each other; every page says so, at most
        shared_account_max_users users run servers at a time, and as root it needs
        allow_root_servers.""",
    )
    allow_root_servers = Bool(
        False,
        config=True,
        help="""Let servers run as root when server_accounts is 'hub' and the hub is root: for a
        single-person install only. Every user's code then runs as root; every page says so.""",
    )
    shared_account_max_users = Integer(
        1,
        config=True,
        help="""With server_accounts = 'hub', how many different users may have servers running
        at once. All of them share one OS account and can read and kill each other's work.""",
    )
    system_account_prefix = Unicode(
        "gpulab-",
        config=True,
        help="""Prefix of the system accounts made for hub users ('gpulab-alice'). A hub name
        that is not a valid short POSIX user name gets a cleaned name plus 8 hex digits of its
        SHA-256 ('gpulab-bob-x-1a2b3c4d').""",
    )
    system_account_uid_range = Tuple(
        Integer(),
        Integer(),
        default_value=(200000, 299999),
        config=True,
        help="""uids and gids of the accounts made for hub users, inclusive. An existing account
        is used only when its uid is in this range and its comment names the hub user.""",
    )

    @default("server_accounts")
    def _default_server_accounts(self) -> str:
        return _default_server_accounts()

    @validate("server_accounts")
    def _check_server_accounts(self, proposal: Any) -> str:
        value = str(proposal["value"])
        if value == "per-user" and os.geteuid() != 0:
            raise TraitError(
                "GPUSimpleLocalSpawner.server_accounts = 'per-user' needs a hub running as root "
                "(it switches to each user's account); use 'hub' or run the hub as root"
            )
        return value

    @validate("system_account_uid_range")
    def _check_uid_range(self, proposal: Any) -> tuple[int, int]:
        lo, hi = proposal["value"]
        if not 1000 <= lo <= hi:
            raise TraitError(
                f"GPUSimpleLocalSpawner.system_account_uid_range {lo}-{hi} must be an "
                "ascending range of uids from 1000 up"
            )
        return (int(lo), int(hi))

    @default("home_dir_template")
    def _default_home_dir_template(self) -> str:
        return os.path.join(os.getcwd(), "homes", "{username}", "{servername}")

    @classmethod
    def hub_start_problems(cls, config: Any) -> list[str]:
        """`ChecksHubStart`: with an account per user, each must pass through every directory
        above her home and snapshots (a state directory under a `mktemp -d` one cannot)."""
        if cls.class_setting(config, "server_accounts", _default_server_accounts()) != "per-user":
            return []  # servers run as the hub's own account
        template = cls.class_setting(config, "home_dir_template", "") or os.path.join(
            os.getcwd(), "homes", "{username}"
        )
        roots = {
            "homes": os.path.dirname(template.split("{", 1)[0] + "x"),
            "snapshots": os.path.abspath(cls.class_setting(config, "snapshot_root")),
        }
        problem = unreachable_message(roots)
        return [problem] if problem else []

    @default("home_dir")
    def _default_home_dir(self) -> str:
        return self.home_dir_template.format(
            username=self.user.name, servername=self.workspace_dir_name
        )

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        if state.get("gpulab_workspace") is not None:
            # the home this server's workspace was created in, whatever the server is called now
            self.home_dir = self._default_home_dir()

    # -- accounts -------------------------------------------------------------------------------

    def server_runs_as_hub(self) -> bool:
        return self.server_accounts == "hub"

    def _account_home(self) -> str:
        return str(self._user_dirs()[0])

    def lookup_server_account(self) -> SystemAccount:
        entry = pwd.getpwnam(account_name(self.user.name, self.system_account_prefix))
        try:
            check_account(entry, self.user.name, self.system_account_uid_range)
        except AccountError as e:
            raise web.HTTPError(409, str(e)) from None
        return SystemAccount.from_pwd(entry)

    async def create_server_account(self) -> SystemAccount:
        try:
            account = await ensure_account(
                self.user.name,
                prefix=self.system_account_prefix,
                uid_range=self.system_account_uid_range,
                home=self._account_home(),
            )
        except AccountError as e:
            self.log.error("gpulab: %s", e)
            raise web.HTTPError(409, str(e)) from None
        except AccountCreationFailed as e:
            self.log.error("gpulab: %s", e)
            raise web.HTTPError(500, f"{e}; an admin must look at the hub's log") from None
        self.log.info(
            "Servers of %s run as system account %s (uid %d)",
            self.user.name,
            account.name,
            account.uid,
        )
        return account

    def check_server_accounts(self) -> None:
        if not self.server_runs_as_hub():
            return
        if os.geteuid() == 0 and not self.allow_root_servers:
            raise web.HTTPError(
                403,
                "Servers would run as root (GPUSimpleLocalSpawner.server_accounts = 'hub' in a "
                "hub running as root); an admin must set server_accounts = 'per-user' or, for a "
                "single-person install, allow_root_servers = True",
            )
        others = (
            {
                s.user.name
                for s in self.db.query(type(self.orm_spawner)).filter(
                    type(self.orm_spawner).server != None  # noqa: E711
                )
                if s.user.name != self.user.name
            }
            if self.orm_spawner is not None
            else set()
        )
        if len(others) >= self.shared_account_max_users:
            raise web.HTTPError(
                403,
                f"All servers here run as one OS account, so users are not isolated; "
                f"{len(others)} other user(s) have servers running and at most "
                f"{self.shared_account_max_users} may (GPUSimpleLocalSpawner."
                "shared_account_max_users)",
            )

    def get_args(self) -> list[str]:
        args = list(super().get_args())
        if os.geteuid() == 0 and self.server_runs_as_hub() and "--allow-root" not in args:
            # allow_root_servers: the admin chose a single-person install where servers run as
            # root, which Jupyter Server refuses without this flag
            args.append("--allow-root")
        return args


def shared_account_warning(config: Config) -> str:
    """The banner every hub page shows when servers run without per-user accounts ('' when
    they have them): computed from the hub's config the way GPUSimpleLocalSpawner decides."""
    settings = config.get("GPUSimpleLocalSpawner", {})
    mode = settings.get("server_accounts", _default_server_accounts())
    if mode != "hub":
        return ""
    if os.geteuid() == 0:
        return (
            "Single-person install: every server runs as root "
            "(GPUSimpleLocalSpawner.allow_root_servers). Do not give other people accounts."
        )
    return (
        f"All users' servers run as one OS account ({pwd.getpwuid(os.geteuid()).pw_name}): "
        "users can read each other's files. Run the hub as root for one account per user."
    )
