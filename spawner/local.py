"""gpulab's local spawners: JupyterHub's local-process spawners plus GPU profiles and allocation.

`GPULocalSpawner` runs each server as its user's system account (LocalProcessSpawner);
`GPUSimpleLocalSpawner` runs every server as the hub's account with a home per user, the
single-account default of an embedded install on one workstation or GPU server.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from tornado import web
from traitlets import Float, Unicode, default

from gpulab.spawner.environment import (
    AssignedGPU,
    Enforcement,
    enforcement_for,
    gpu_environment,
    with_caps_hook,
)
from gpulab.spawner.gpu_mixin import GPUSpawnerMixin
from gpulab.spawner.watchdog import (
    GPUMemoryWatchdog,
    NvmlProcessMemory,
    ProcessMemorySource,
    SimulatedProcessMemory,
)
from gpulab.spawner.workspace import LocalWorkspaceMixin


class GPULocalSpawnerMixin(LocalWorkspaceMixin, GPUSpawnerMixin):
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
        placement = self.gpulab_placement
        if placement is None or not self.pid or all(s.milli == 1000 for s in placement.gpus):
            return  # whole GPUs are exclusive; CPU-only servers hold no GPU
        if self.gpu_capacity.inventory_is_declared and not self.simulated_gpu_processes_file:
            return  # no driver, nothing to sample
        limits = {g.uuid: g.memory_limit_mib for g in self.assigned_gpus(placement)}
        self.watchdog.watch(self.allocation_id, self.pid, limits, self._on_over_share)

    async def _on_over_share(self, stage: str, message: str) -> None:
        self.gpu_capacity.record_event(self.allocation_id, stage, message)
        if stage == "stop":
            await self.stop()

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
        if gpu_env.get("GPULAB_CAPS_HOOK"):
            env["PYTHONPATH"] = with_caps_hook(env.get("PYTHONPATH"))
        if self.gpulab_profile is not None:
            env["GPULAB_PROFILE"] = self.gpulab_profile.slug
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
        await self.apply_workspace_options()
        await self.gpulab_allocate(profile)
        try:
            await self.prepare_workspace(self.workspace_home_dir())
            url = await super().start()
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
        await self.snapshot_workspace(self.workspace_home_dir())

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
                await self.snapshot_workspace(self.workspace_home_dir(), label="after-exit")
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
        if self.workspace_name is not None:
            state["gpulab_workspace"] = self.workspace_name
        if self.workspace_auto_restore:
            state["gpulab_auto_restore"] = True
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        if state.get("gpulab_allocation"):
            self.restore_placement()
        slug = state.get("gpulab_profile")
        if slug:
            self.gpulab_profile = self.gpu_capacity.profile(slug)
        if state.get("gpulab_workspace") is not None:
            self.workspace_name = state["gpulab_workspace"]
        self.workspace_auto_restore = bool(state.get("gpulab_auto_restore"))

    def clear_state(self) -> None:
        super().clear_state()
        self.gpulab_profile = None
        # workspace_name and workspace_auto_restore stay: the workspace outlives the process

    async def progress(self) -> Any:
        async for event in self.gpulab_progress():
            yield event


class GPULocalSpawner(GPULocalSpawnerMixin, LocalProcessSpawner):
    """Each server runs as its user's system account, with a whole or fractional GPU."""

    @default("checkpoints")
    def _default_checkpoints(self) -> bool:
        # the workspace set-up writes into the user's home as the hub's account; until it runs as
        # the user, system-account servers opt in explicitly
        return False


class GPUSimpleLocalSpawner(GPULocalSpawnerMixin, SimpleLocalProcessSpawner):
    """Every server runs as the hub's own account, with a home directory per user and server: the
    embedded single-account default. Users are not isolated from each other at the OS level; use
    GPULocalSpawner (system users) or GPUKubeSpawner where that matters."""

    home_dir_template = Unicode(
        config=True,
        help="""Where each server's home (its persistent volume) lives. {username} is the user's
        name, {servername} the server's name ('default' for the default server), so that a named
        server, or a clone of a workspace, has a home of its own. Default: homes/{username}/{servername}
        under the hub's directory.""",
    )

    @default("home_dir_template")
    def _default_home_dir_template(self) -> str:
        return os.path.join(os.getcwd(), "homes", "{username}", "{servername}")

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

    def get_args(self) -> list[str]:
        args = list(super().get_args())
        if os.geteuid() == 0 and "--allow-root" not in args:
            # every server runs as the hub's account; when that is root (containers, CI), Jupyter
            # Server refuses to start without this flag
            args.append("--allow-root")
        return args
