"""The warm-pool side of gpulab's local spawners: their pool's members, and a start served by one.

`LocalWarmStartMixin` is a part of `GPULocalSpawnerMixin` (`gpulab.spawner.local.spawner`), apart
because a warm start is a path of its own through a start, with the hub's pool service
(`gpulab.hub.warmpoolservice`) and the members' process (`gpulab.spawner.local.warm_pool`) on
its other side: a start claims a ready member of the profile, binds it to the user's account,
home and environment, and falls back to a cold start where it cannot. It relies on the spawner's
account (`server_runs_as_hub`, `_server_account`) and on `GPUSpawnerMixin.claim_warm_member`.
"""

from __future__ import annotations

import os
from typing import Any

from jupyterhub.utils import random_port

from gpulab.hub.capacity import GPUCapacity


class LocalWarmStartMixin:
    """Warm pool members of the embedded default (`KeepsWarmServers`) and a start served by one."""

    @classmethod
    def warm_pool_backend(cls, *, config: Any, log: Any) -> Any:
        """The embedded default's warm pool members (`KeepsWarmServers`), made before any
        spawner exists: the settings they need are read from `config` as traitlets would
        resolve them for this class (a subclass's section over its parents')."""
        from gpulab.spawner.local.warm_pool import DEFAULT_ENV_KEEP, LocalWarmBackend

        def configured(name: str, fallback: Any) -> Any:
            return cls.class_setting(config, name, fallback)

        capacity = GPUCapacity.instance(config=config, log=log)
        return LocalWarmBackend(
            capacity.gpu_by_uuid,
            env_keep=tuple(configured("env_keep", DEFAULT_ENV_KEEP)),
            mps_pipe_directory=str(configured("mps_pipe_directory", "")),
            mps_log_directory=str(configured("mps_log_directory", "")),
        )

    def _warm_claim_possible(self) -> bool:
        """Whether this start may be served by a member: the stock server command run as a cold
        start would run it (a custom command, shell or Popen setting makes another server)."""
        cmd = list(self.cmd)
        stock = len(cmd) == 1 and os.path.basename(cmd[0]) == "jupyterhub-singleuser"
        return stock and not self.shell_cmd and not self.popen_kwargs

    def _binding_account(self) -> tuple[int, int, tuple[int, ...]]:
        if self.server_runs_as_hub():
            return os.geteuid(), os.getegid(), tuple(os.getgroups())
        account = self._server_account
        if account is None:  # never fall back to the hub's account (root) for user code
            raise RuntimeError(f"no system account resolved for {self.user.name} before its start")
        return account.uid, account.gid, tuple(os.getgrouplist(account.name, account.gid))

    async def _claim_warm(self, profile: Any) -> Any:
        """A ready pool member of `profile` whose reservation is now this server's allocation
        (her quota and budget checked), or None: start cold (a refusal then gets its usual
        words from `gpulab_allocate`; a member that could not be handed over is discarded)."""
        if not self._warm_claim_possible():
            return None
        return await self.claim_warm_member(profile)

    async def _bind_warm(self, member: Any, profile: Any) -> Any:
        """Make the claimed `member` this user's server (her account, home, environment); its
        address, or None when it cannot serve: the member is discarded and the server starts
        cold on the share it handed over."""
        from gpulab.hub.warmpoolservice import GPUWarmPool, WarmStartFailed
        from gpulab.spawner.local.warm_pool import Binding

        pool = GPUWarmPool.instance(config=self.config, log=self.log)
        try:
            if self.port == 0:
                self.port = random_port()
            uid, gid, groups = self._binding_account()
            binding = Binding(
                uid=uid,
                gid=gid,
                groups=groups,
                home=str(self.workspace_home_dir()),
                env=self.get_env(),
                argv=[*self.cmd, *self.get_args()],
                directory_only=not self.checkpoints,
            )
            pid = await member.bind(binding)
        except (WarmStartFailed, OSError) as e:
            self.log.warning(
                "Warm member %s could not serve %s (%s); starting cold",
                member.id,
                self.allocation_id,
                e,
            )
            await pool.discard(member)
            return None
        except BaseException:
            await pool.discard(member)
            raise
        self.proc = member.proc
        self.pid = pid
        self.log.info(
            "GPU allocation %s (profile %s) served warm by %s (pid %s) on %s",
            self.allocation_id,
            profile.slug,
            member.id,
            pid,
            self.gpulab_placement.node if self.gpulab_placement else "?",
        )
        return (self.ip or "127.0.0.1", self.port)
