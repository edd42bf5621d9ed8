"""What both workspace backends share: `WorkspaceSpawnerMixin`, the half of
`gpulab.hub.workspaces.Workspaces` (the contract the hub holds spawners to) that does not depend
on where homes live. It holds the traits both backends have (defined here once, with one help
text), the one-shot start choices (restore a snapshot, restore kernel variables), the
workspace's name and the state it keeps; `workspaces.local` and `workspaces.kube` add how each
stores homes and snapshots.

`tests/spawner/workspaces/test_contract.py` checks that both backends implement `Workspaces` with
the same signatures, and runs the same behaviour (snapshot, list, restore, clone, offer, refusals)
against each through a real hub.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tornado import web
from traitlets import Bool, Integer, Unicode

from gpulab.hub.refusals import refusal, shown
from gpulab.hub.workspaces import (
    DEFAULT_HOME,
    CloneResult,
    RestoreResult,
    SnapshotListing,
    WorkspaceOffer,
    Workspaces,
    keeps_workspaces,
)
from gpulab.spawner.singleuser.checkpoint import derive_user_key
from gpulab.spawner.singleuser.checkpoint.secret import load_or_create_secret
from gpulab.spawner.workspaces.schedule import SnapshotScheduleMixin

#: one-shot choices about the workspace in `user_options`, applied at the next start, then forgotten
WORKSPACE_OPTION_KEYS = frozenset({"restore_snapshot", "restore_kernels"})


def workspace_choices(user_options: Any) -> tuple[str | None, bool]:
    """(snapshot to restore the home from, restore kernel variables without asking), checked:
    a readable 400 for a malformed choice."""
    options = user_options if isinstance(user_options, dict) else {}
    snapshot = options.get("restore_snapshot")
    if snapshot is not None and (not isinstance(snapshot, str) or not snapshot):
        raise refusal(
            400, f"'restore_snapshot' must be a snapshot id (a string), got {shown(snapshot)}"
        )
    kernels = options.get("restore_kernels", False)
    if not isinstance(kernels, bool):
        raise refusal(400, f"'restore_kernels' must be true or false, got {shown(kernels)}")
    return snapshot, kernels


def without_workspace_choices(options: Any) -> Any:
    """`options` less the one-shot workspace choices (as it was when it holds none)."""
    if isinstance(options, dict) and WORKSPACE_OPTION_KEYS & set(options):
        return {k: v for k, v in options.items() if k not in WORKSPACE_OPTION_KEYS}
    return options


class WorkspaceSpawnerMixin(SnapshotScheduleMixin):
    """What both backends' workspaces share (options, one-shot start choices, state), mixed into
    each gpulab spawner."""

    if TYPE_CHECKING:  # the spawner's own attributes, which this mixin uses
        from logging import Logger

        user: Any
        name: str
        user_options: Any
        log: Logger

        def get_state(self) -> dict[str, Any]: ...

    checkpoints = Bool(
        True,
        config=True,
        help="""Keep workspaces: the server's home persists (locally a directory, on Kubernetes
        a PVC per server), so installed packages and conda/venv environments survive; kernel
        variables are checkpointed (signed per user) and offered back on the next start; the
        home is snapshotted each time the server stops. On Kubernetes, off with an upstream
        `profile_list`.""",
    )
    checkpoint_grace_seconds = Integer(
        30,
        config=True,
        help="""How long a stopping server waits for each kernel's final checkpoint
        (--KernelManager.shutdown_wait_time). On Kubernetes the default is half of what
        `delete_grace_period` leaves after the preStop hook.""",
    )
    checkpoint_secret_file = Unicode(
        "gpulab-checkpoint-secret",
        config=True,
        help="""File holding the hub secret that per-user checkpoint keys are derived from
        (created with 32 random bytes, mode 0600, on first use; relative to the hub's directory).
        Both backends read the same file by default, so a user's key is the same on both.""",
    )
    snapshot_keep_last = Integer(5, config=True, help="Snapshots kept per server: the newest N...")
    snapshot_keep_daily = Integer(
        7, config=True, help="...plus the newest of each of the last D days."
    )

    #: the server's name when its workspace was created: a renamed server keeps its home
    workspace_name: str | None = None
    #: restore kernel variables without asking on the next start (the picker's choice, or a
    #: server lost rather than stopped); reset after that start
    workspace_auto_restore: bool = False

    # -- the contract's shared part ---------------------------------------------------------------

    @property
    def workspaces_enabled(self) -> bool:
        return bool(self.checkpoints)

    @property
    def workspace_dir_name(self) -> str:
        name = self.name if self.workspace_name is None else self.workspace_name
        return name or DEFAULT_HOME

    def workspace_home_id(self) -> str:
        return self.workspace_dir_name

    def _user_key(self) -> bytes:
        """The user's checkpoint signing key, derived from the hub's secret."""
        return derive_user_key(load_or_create_secret(self.checkpoint_secret_file), self.user.name)

    async def take_workspace_snapshot(self, label: str = "on-demand") -> SnapshotListing | None:
        return await self.snapshot_workspace(label, raise_errors=True)

    # -- what each backend implements -------------------------------------------------------------

    def workspace_env(self, base_env: Mapping[str, str]) -> dict[str, str]:
        """The server's workspace environment (HOME, package and environment locations, the
        kernel checkpoint directory, the key's file name); `base_env` is what the server's
        environment holds already. Empty when workspaces are off."""
        raise NotImplementedError

    def workspace_args(self) -> list[str]:
        """Arguments for the server (its kernels' shutdown wait for the final checkpoint)."""
        raise NotImplementedError

    async def snapshot_workspace(
        self, label: str = "on-stop", *, raise_errors: bool = False
    ) -> SnapshotListing | None:
        """Snapshot the home and apply retention; None when workspaces are off or there is no
        home yet. Failures are logged, or raised with `raise_errors`."""
        raise NotImplementedError

    async def restore_workspace(self, snapshot_id: str) -> RestoreResult:
        raise NotImplementedError

    def resume_reason(self) -> str | None:
        """Why the last run ended when the next start should restore its kernels by itself
        (the Kubernetes backend: preempted, node lost); None otherwise."""
        return None

    # -- the start's one-shot choices --------------------------------------------------------------

    def forget_workspace_options(self) -> None:
        """The workspace choices hold for one start: JupyterHub reuses a server's last options
        when a start names none, and a second restore would throw away work done since."""
        self.user_options = without_workspace_choices(self.user_options)
        orm_spawner = getattr(self, "orm_spawner", None)
        if orm_spawner is not None:
            orm_spawner.user_options = without_workspace_choices(orm_spawner.user_options)

    async def apply_workspace_options(self) -> None:
        """The start's one-shot choices (restore the home from a snapshot, restore kernel
        variables without asking) and a resume after an interruption, applied before anything
        is allocated."""
        snapshot_id, restore_kernels = workspace_choices(self.user_options)
        self.forget_workspace_options()
        if not self.workspaces_enabled:
            if snapshot_id or restore_kernels:
                raise web.HTTPError(400, "Workspace checkpoints are off for this server")
            return
        resume = self.resume_reason()
        self.workspace_auto_restore = bool(restore_kernels or resume or self.workspace_auto_restore)
        if resume:
            self.log.info(
                "Server %s/%s ended (%s): its kernels restore their variables without asking",
                self.user.name,
                self.name,
                resume,
            )
        if snapshot_id:
            try:
                await self.restore_workspace(snapshot_id)
            except KeyError:
                raise web.HTTPError(
                    400,
                    f"No snapshot {snapshot_id[:80]!r} of server {self.user.name}/{self.name}; "
                    f"GET /hub/api/gpulab/users/{self.user.name}/snapshots lists them",
                ) from None

    # -- state ---------------------------------------------------------------------------------------

    def workspace_state(self) -> dict[str, Any]:
        """What the hub's database keeps of the workspace (it outlives the server's process)."""
        state: dict[str, Any] = {}
        if self.workspace_name is not None:
            state["gpulab_workspace"] = self.workspace_name
        if self.workspace_auto_restore:
            state["gpulab_auto_restore"] = True
        return state

    def load_workspace_state(self, state: Mapping[str, Any]) -> None:
        if state.get("gpulab_workspace") is not None:
            self.workspace_name = state["gpulab_workspace"]
        self.workspace_auto_restore = bool(state.get("gpulab_auto_restore"))


__all__ = [
    "DEFAULT_HOME",
    "WORKSPACE_OPTION_KEYS",
    "CloneResult",
    "RestoreResult",
    "SnapshotListing",
    "WorkspaceOffer",
    "WorkspaceSpawnerMixin",
    "Workspaces",
    "keeps_workspaces",
    "workspace_choices",
    "without_workspace_choices",
]
