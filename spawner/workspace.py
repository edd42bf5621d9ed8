"""Local workspaces that come back as they were left: packages and environments kept in the home,
kernel variables checkpointed by gpulab's IPython extension, home snapshots on every stop.

A mixin of the local spawners; the pieces themselves live in `gpulab.spawner.checkpoint`.
"""

from __future__ import annotations

import asyncio
import pwd
from pathlib import Path

from tornado import web
from traitlets import Bool, Integer, Unicode

from gpulab.spawner.checkpoint import derive_user_key
from gpulab.spawner.checkpoint import snapshots as snaps
from gpulab.spawner.checkpoint.environment import persistent_env, prepare_home, server_args
from gpulab.spawner.checkpoint.secret import load_or_create_secret
from gpulab.spawner.checkpoint.store import human_bytes, list_checkpoints
from gpulab.spawner.snapshot_schedule import SCHEDULED, SnapshotScheduleMixin


def server_dir_name(server_name: str) -> str:
    """The directory name of a server's home and snapshot store: its name, 'default' for the
    default server."""
    return server_name or "default"


def _listing(snap: snaps.Snapshot) -> dict[str, object]:
    return {
        "id": snap.id,
        "label": snap.label,
        "created": snap.created,
        "files": snap.files,
        "bytes": snap.bytes,
        "size": human_bytes(snap.bytes),
    }


class LocalWorkspaceMixin(SnapshotScheduleMixin):
    checkpoints = Bool(
        True,
        config=True,
        help="""Keep workspaces: installed packages and conda/venv environments in the home, kernel
        variables checkpointed (signed per user) and offered back on the next start, and a
        snapshot of the home each time the server stops.""",
    )
    checkpoint_grace_seconds = Integer(
        30,
        config=True,
        help="How long a stopping server's kernels get to write their final checkpoint.",
    )
    checkpoint_secret_file = Unicode(
        "gpulab-checkpoint-secret",
        config=True,
        help="""File holding the hub secret that per-user checkpoint keys are derived from
        (created with 32 random bytes, mode 0600, on first use; relative to the hub's directory).""",
    )
    snapshot_root = Unicode(
        "snapshots",
        config=True,
        help="Where home snapshots are kept, one store per user and server (outside the homes).",
    )
    snapshot_keep_last = Integer(5, config=True, help="Snapshots kept per server: the newest N...")
    snapshot_keep_daily = Integer(
        7, config=True, help="...plus the newest of each of the last D days."
    )

    #: restore kernel variables without asking on the next start (the picker's "restore kernel
    #: variables" choice, or a respawn after the server was lost); reset after that start
    workspace_auto_restore: bool = False
    #: the server's name when its workspace was created: a renamed server keeps its home
    workspace_name: str | None = None

    @property
    def workspace_dir_name(self) -> str:
        return server_dir_name(self.name if self.workspace_name is None else self.workspace_name)

    def _checkpoint_secret(self) -> bytes:
        return load_or_create_secret(self.checkpoint_secret_file)

    def workspace_home_dir(self) -> Path:
        """The server's home: the single-account spawner's home_dir, else the user's account's."""
        home = getattr(self, "home_dir", "")
        return Path(home) if home else Path(pwd.getpwnam(self.user.name).pw_dir)

    def workspace_env(self, env: dict[str, str]) -> dict[str, str]:
        """Environment additions for the server process (empty when checkpoints are off)."""
        if not self.checkpoints:
            return {}
        home = self.workspace_home_dir()
        return persistent_env(
            home,
            server=self.workspace_dir_name,
            base_env=env,
            key=self._user_key(),
            user=self.user.name,
            auto_restore=self.workspace_auto_restore,
        )

    def _user_key(self) -> bytes:
        return derive_user_key(self._checkpoint_secret(), self.user.name)

    def workspace_args(self) -> list[str]:
        return server_args(self.checkpoint_grace_seconds) if self.checkpoints else []

    def snapshot_store(self) -> Path:
        return Path(self.snapshot_root).resolve() / self.user.name / self.workspace_dir_name

    async def prepare_workspace(self, home: Path) -> None:
        if self.workspace_name is None:
            self.workspace_name = self.name
        if self.checkpoints:
            # the kernels' stop takes their final save: give the server that long to stop
            self.interrupt_timeout = max(
                self.interrupt_timeout, 2 * self.checkpoint_grace_seconds + 5
            )
            await asyncio.to_thread(prepare_home, home)

    async def snapshot_workspace(
        self, home: Path, label: str = "on-stop", *, raise_errors: bool = False
    ) -> dict[str, object] | None:
        """Snapshot the home into the server's store and apply retention; the snapshot's listing
        entry, or None when checkpoints are off or there is no home yet."""
        if not self.checkpoints:
            return None
        store = self.snapshot_store()

        def take() -> snaps.Snapshot | None:
            if not home.is_dir():
                return None
            snap = snaps.snapshot(home, store, label)
            snaps.apply_retention(
                store, keep_last=self.snapshot_keep_last, keep_daily=self.snapshot_keep_daily
            )
            return snap

        try:
            snap = await asyncio.to_thread(take)
        except Exception:
            if raise_errors:
                raise
            self.log.exception("Snapshot of %s's home %s failed", self.user.name, home)
            return None
        return _listing(snap) if snap else None

    async def take_workspace_snapshot(self, label: str = "on-demand") -> dict[str, object] | None:
        """A snapshot now (hub API, workspaces page); the server may be running."""
        return await self.snapshot_workspace(self.workspace_home_dir(), label, raise_errors=True)

    # -- scheduled snapshots of running servers (SnapshotScheduleMixin) -------------------------

    def snapshot_schedule_wanted(self) -> bool:
        return bool(self.checkpoints)

    async def scheduled_snapshot(self) -> None:
        # files are copied one at a time while the server runs: each file is consistent, the
        # tree as a whole is as of the walk (the on-stop snapshot is the exact one)
        await self.snapshot_workspace(self.workspace_home_dir(), label=SCHEDULED)

    # -- restore and clone (hub API, picker) ---------------------------------------------------

    async def apply_workspace_options(self) -> None:
        """The start's one-shot workspace choices: restore the home from a snapshot, restore
        kernel variables without asking. Applied before anything is allocated."""
        snapshot_id, restore_kernels = self.workspace_options(self.user_options)  # type: ignore[attr-defined]
        self.forget_workspace_options()  # type: ignore[attr-defined]
        if restore_kernels:
            self.workspace_auto_restore = True
        if snapshot_id:
            if not self.checkpoints:
                raise web.HTTPError(400, "Workspace checkpoints are off for this server")
            try:
                await self.restore_workspace(snapshot_id)
            except KeyError:
                raise web.HTTPError(
                    400,
                    f"No snapshot {snapshot_id!r} of server {self.user.name}/{self.name}; "
                    f"GET /hub/api/gpulab/users/{self.user.name}/snapshots lists them",
                ) from None

    async def workspace_offer(self) -> dict[str, object] | None:
        """What the picker offers before a start: the kernel checkpoints that would be restored
        (one per notebook, e.g. 'Restore 23 variables (1.2 GB, saved 10:32)') and the home
        snapshots to start from. None when checkpoints are off."""
        if not self.checkpoints:
            return None
        root = self.workspace_home_dir() / ".gpulab" / "checkpoints" / self.workspace_dir_name
        key, user = self._user_key(), self.user.name
        found = await asyncio.to_thread(list_checkpoints, root, key, user)
        kernels = [
            {"notebook": slot, "offer": m.describe(), "variables": m.count, "bytes": m.data_bytes}
            for slot, m in found.items()
        ]
        return {"kernels": kernels, "snapshots": await self.list_workspace_snapshots()}

    async def list_workspace_snapshots(self) -> list[dict[str, object]]:
        found = await asyncio.to_thread(snaps.list_snapshots, self.snapshot_store())
        return [_listing(s) for s in reversed(found)]

    async def restore_workspace(self, snapshot_id: str) -> dict[str, object]:
        """Put the home back as it was in `snapshot_id` (the server must be stopped); the home as
        it was just before is kept as a 'before-restore' snapshot. KeyError: no such snapshot."""
        home, store = self.workspace_home_dir(), self.snapshot_store()

        def restore() -> str | None:
            try:
                snap = snaps.get_snapshot(store, snapshot_id)
            except snaps.SnapshotError as e:
                raise KeyError(str(e)) from None
            before = snaps.restore(snap, home)
            return before.id if before else None

        before_id = await asyncio.to_thread(restore)
        self.log.info("Restored %s's home %s to snapshot %s", self.user.name, home, snapshot_id)
        return {"restored": snapshot_id, "before_restore": before_id}

    async def clone_workspace(
        self, snapshot_id: str, target: LocalWorkspaceMixin
    ) -> dict[str, object]:
        """Give `target` (a new, never started server of the same user) a home with the content
        of this server's snapshot `snapshot_id`, kernel checkpoints included. KeyError: no such
        snapshot; FileExistsError: the target already has a home."""
        store, new_home = self.snapshot_store(), target.workspace_home_dir()
        rename = (self.workspace_dir_name, target.workspace_dir_name)

        def clone() -> None:
            try:
                snap = snaps.get_snapshot(store, snapshot_id)
            except snaps.SnapshotError as e:
                raise KeyError(str(e)) from None
            if new_home.exists() and any(new_home.iterdir()):
                raise FileExistsError(f"{new_home} is not empty")
            if new_home.exists():
                new_home.rmdir()
            snaps.clone(snap, new_home, rename_server=rename)

        await asyncio.to_thread(clone)
        target.workspace_name = target.name
        self.log.info(
            "Cloned %s's snapshot %s of server %r into server %r (%s)",
            self.user.name,
            snapshot_id,
            self.name,
            target.name,
            new_home,
        )
        return {"cloned": snapshot_id, "server": target.name}
