"""Local workspaces that come back as they were left: packages and environments kept in the home,
kernel variables checkpointed by gpulab's IPython extension, home snapshots on every stop.

A mixin of the local spawners; the pieces themselves live in `gpulab.spawner.singleuser.checkpoint`.

Where servers run as their user's own account (the embedded default when the hub is root), the
hub never reads or writes inside a user's home or snapshot store as root: it makes the user's top
directories, writes her key file, and runs everything else (snapshot, list, restore, clone, the
checkpoint offer) as her account through `gpulab.spawner.singleuser.checkpoint.worker`; the server's own
command prepares the home (`gpulab.spawner.singleuser.checkpoint.prepare`), also as her.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import secrets
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from traitlets import Unicode

from gpulab.spawner.local.accounts import SystemAccount, account_name, adopt_tree
from gpulab.spawner.singleuser.checkpoint import key_to_text
from gpulab.spawner.singleuser.checkpoint.environment import persistent_env, server_args
from gpulab.spawner.singleuser.checkpoint.worker import WorkspaceOpError, run_op
from gpulab.spawner.workspaces.base import (
    CloneResult,
    RestoreResult,
    SnapshotListing,
    WorkspaceOffer,
    WorkspaceSpawnerMixin,
)
from gpulab.spawner.workspaces.schedule import SCHEDULED

#: how long one workspace operation of the worker may take: a snapshot, restore or clone copies
#: a whole home; a listing or the picker's offer only reads manifests
WORKER_TIMEOUT_SECONDS = {"snapshot": 600.0, "restore": 600.0, "clone": 600.0}
WORKER_READ_TIMEOUT_SECONDS = 60.0


class LocalWorkspaceMixin(WorkspaceSpawnerMixin):
    """Homes as directories, snapshots in a store per server, kernel checkpoint keys as files:
    the local spawners' implementation of `gpulab.hub.workspaces.Workspaces`."""

    snapshot_root = Unicode(
        "snapshots",
        config=True,
        help="Where home snapshots are kept, one store per user and server (outside the homes).",
    )
    checkpoint_key_dir = Unicode(
        "checkpoint-keys",
        config=True,
        help="""Where the hub writes each user's checkpoint signing key, one file per user, owned
        by the user's server account with mode 0400 (relative to the hub's directory). The
        directory itself is the hub's (0711): users open their own file by name and cannot list
        or open anyone else's.""",
    )

    # -- whose files: the backends say (local.py) ------------------------------------------------

    async def workspace_account(self, create: bool = False) -> SystemAccount | None:
        """The account the server's files belong to, or None when it is the hub's own (a
        shared-account install). `create`: make it when missing (before a start); otherwise a
        missing account means the user has no files yet, and None is not returned for it
        (`LookupError`)."""
        return None

    def workspace_home_dir(self) -> Path:
        """The server's home: the single-account spawner's home_dir, else the user's account's."""
        home = getattr(self, "home_dir", "")
        return Path(home) if home else Path(pwd.getpwnam(self.user.name).pw_dir)

    def checkpoint_key_file(self) -> Path:
        """The user's key file (see `checkpoint_key_dir`); its name is the user's name made safe
        for a file name, so two hub users never share one."""
        return Path(self.checkpoint_key_dir).resolve() / f"{account_name(self.user.name, 'key-')}"

    def workspace_env(self, base_env: Mapping[str, str]) -> dict[str, str]:
        """Environment additions for the server process (empty when checkpoints are off). The
        key is named by its file, never put in the environment (see `signing.KEY_FILE_ENV`)."""
        if not self.checkpoints:
            return {}
        return persistent_env(
            self.workspace_home_dir(),
            server=self.workspace_dir_name,
            base_env=dict(base_env),
            key_file=self.checkpoint_key_file(),
            user=self.user.name,
            auto_restore=self.workspace_auto_restore,
        )

    def workspace_args(self) -> list[str]:
        return server_args(self.checkpoint_grace_seconds) if self.checkpoints else []

    def snapshot_dir(self) -> Path:
        """The server's snapshot store: a directory per user and server under `snapshot_root`."""
        return Path(self.snapshot_root).resolve() / self.user.name / self.workspace_dir_name

    def snapshot_store(self) -> str:
        return str(self.snapshot_dir())

    # -- the hub's part: top directories and the key file (as root, only in its own dirs) --------

    def _user_dirs(self) -> list[Path]:
        """Directories the hub makes for the user before a start and hands to her account: the
        one that holds her server homes (`home_dir_template`'s `{username}` level) and her
        snapshot stores. Everything below them is made by her own processes."""
        home = self.workspace_home_dir()
        template = getattr(self, "home_dir_template", "")
        user_dir = home.parent if "{servername}" in template else home
        return [user_dir, self.snapshot_dir().parent]

    def _write_key_file(self, account: SystemAccount | None) -> None:
        """Write the user's key file whole: a private temporary name, owner and mode set on the
        open file, then renamed into place. The directory is the hub's and nobody else can write
        to it, so no user can put a symlink where the hub writes."""
        path = self.checkpoint_key_file()
        hub_private_dir(path.parent, mode=0o711)
        text = key_to_text(self._user_key())
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                if account is not None:
                    os.fchown(f.fileno(), account.uid, account.gid)
                os.fchmod(f.fileno(), 0o400)
                f.write(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _prepare_user_dirs(self, account: SystemAccount | None) -> None:
        for path in self._user_dirs():
            if account is None:  # one account for everyone: nothing to hand over
                path.mkdir(parents=True, exist_ok=True, mode=0o700)
                continue
            hub_private_dir(path.parent, mode=0o711)
            with contextlib.suppress(FileExistsError):
                path.mkdir(mode=0o700)
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise RuntimeError(f"{path} is not a directory")
            if st.st_uid == account.uid:
                continue  # hers already (an existing system user's home keeps its mode)
            if st.st_uid != os.geteuid():
                raise RuntimeError(
                    f"{path} belongs to uid {st.st_uid}, not to {account.name} ({account.uid})"
                )
            # made just now, or before servers ran as their own accounts: hand it over. The
            # parent is the hub's (checked above), so `path` cannot be swapped meanwhile.
            for item in adopt_tree(path, account.uid, account.gid):
                self.log.warning("Left %s as it was: it has links outside %s", item, path)
            os.chmod(path, 0o700, follow_symlinks=False)

    async def prepare_workspace(self, home: Path) -> None:
        """Before a start: the server's account (made on the user's first start), her
        directories and, with checkpoints on, her key file. The home itself is prepared by the
        server's command, as the server's account."""
        if self.workspace_name is None:
            self.workspace_name = self.name
        account = await self.workspace_account(create=True)
        if self.checkpoints:
            # the kernels' stop takes their final save: give the server that long to stop
            self.interrupt_timeout = max(
                self.interrupt_timeout, 2 * self.checkpoint_grace_seconds + 5
            )

        def prepare() -> None:
            self._prepare_user_dirs(account)
            if self.checkpoints:
                self._write_key_file(account)

        await asyncio.to_thread(prepare)

    # -- operations on the user's files, as the user --------------------------------------------

    async def _workspace_op(self, op: str, **args: Any) -> Any:
        """Run a `checkpoint.worker` operation as the workspace's account (in a thread when that
        is the hub's own). LookupError: the user has no account, hence no files, yet."""
        account = await self.workspace_account()
        if account is None:
            return await asyncio.to_thread(run_op, op, args)
        request = json.dumps({"op": op, "args": args}).encode()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",  # no user site, no PYTHON* variables: the worker is gpulab's code only
            "-m",
            "gpulab.spawner.singleuser.checkpoint.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd="/",
            env={"PATH": os.defpath, "HOME": account.home, "LANG": "C.UTF-8"},
            user=account.uid,
            group=account.gid,
            extra_groups=[],
        )
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(request),
                WORKER_TIMEOUT_SECONDS.get(op, WORKER_READ_TIMEOUT_SECONDS),
            )
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"workspace {op} for {self.user.name} timed out") from None
        try:
            answer = json.loads(out)
        except ValueError:
            raise RuntimeError(
                f"workspace {op} for {self.user.name} failed (exit {proc.returncode}): "
                f"{err.decode(errors='replace')[-2000:]}"
            ) from None
        if not answer.get("ok"):
            kind, message = answer.get("kind", "failed"), str(answer.get("message", ""))
            if kind in ("not-found", "exists"):
                raise WorkspaceOpError(kind, message)
            raise RuntimeError(f"workspace {op} for {self.user.name}: {message}")
        return answer.get("result")

    async def snapshot_workspace(
        self, label: str = "on-stop", *, raise_errors: bool = False
    ) -> SnapshotListing | None:
        """Snapshot the home into the server's store and apply retention; the snapshot's listing
        entry, or None when checkpoints are off or there is no home yet."""
        if not self.checkpoints:
            return None
        home = self.workspace_home_dir()
        try:
            snap: SnapshotListing | None = await self._workspace_op(
                "snapshot",
                home=str(home),
                store=self.snapshot_store(),
                label=label,
                keep_last=self.snapshot_keep_last,
                keep_daily=self.snapshot_keep_daily,
            )
        except LookupError:
            return None  # no account: never started, nothing to snapshot
        except Exception:
            if raise_errors:
                raise
            self.log.exception("Snapshot of %s's home %s failed", self.user.name, home)
            return None
        return snap

    # -- scheduled snapshots of running servers (SnapshotScheduleMixin) -------------------------

    def snapshot_schedule_wanted(self) -> bool:
        return bool(self.checkpoints)

    async def scheduled_snapshot(self) -> None:
        # files are copied one at a time while the server runs: each file is consistent, the
        # tree as a whole is as of the walk (the on-stop snapshot is the exact one)
        await self.snapshot_workspace(SCHEDULED)

    # -- restore and clone (hub API, picker) ---------------------------------------------------

    async def workspace_offer(self) -> WorkspaceOffer | None:
        """What the picker offers before a start: the kernel checkpoints that would be restored
        (one per notebook, e.g. 'Restore 23 variables (1.2 GB, saved 10:32)') and the home
        snapshots to start from. None when checkpoints are off."""
        if not self.checkpoints:
            return None
        root = self.workspace_home_dir() / ".gpulab" / "checkpoints" / self.workspace_dir_name
        try:
            kernels = await self._workspace_op(
                "offer",
                root=str(root),
                key_file=str(self.checkpoint_key_file()),
                user=self.user.name,
            )
        except LookupError:
            kernels = []
        return {"kernels": kernels, "snapshots": await self.list_workspace_snapshots()}

    async def list_workspace_snapshots(self) -> list[SnapshotListing]:
        try:
            found: list[SnapshotListing] = await self._workspace_op(
                "list", store=self.snapshot_store()
            )
        except LookupError:
            return []
        return found

    async def restore_workspace(self, snapshot_id: str) -> RestoreResult:
        """Put the home back as it was in `snapshot_id` (the server must be stopped); the home as
        it was just before is kept as a 'before-restore' snapshot. KeyError: no such snapshot."""
        home, store = self.workspace_home_dir(), self.snapshot_store()
        try:
            result = await self._workspace_op(
                "restore", store=store, snapshot_id=snapshot_id, home=str(home)
            )
        except (WorkspaceOpError, LookupError) as e:
            raise KeyError(str(e)) from None
        self.log.info("Restored %s's home %s to snapshot %s", self.user.name, home, snapshot_id)
        return {"restored": snapshot_id, "before_restore": result["before_restore"]}

    async def clone_workspace(self, snapshot_id: str, target: LocalWorkspaceMixin) -> CloneResult:
        """Give `target` (a new, never started server of the same user) a home with the content
        of this server's snapshot `snapshot_id`, kernel checkpoints included. KeyError: no such
        snapshot; FileExistsError: the target already has a home."""
        store, new_home = self.snapshot_store(), target.workspace_home_dir()
        try:
            await self._workspace_op(
                "clone",
                store=store,
                snapshot_id=snapshot_id,
                new_home=str(new_home),
                rename=[self.workspace_dir_name, target.workspace_dir_name],
            )
        except LookupError as e:
            raise KeyError(str(e)) from None
        except WorkspaceOpError as e:
            if e.kind == "exists":
                raise FileExistsError(str(e)) from None
            raise KeyError(str(e)) from None
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


def hub_private_dir(path: Path, mode: int) -> None:
    """`path` (and missing parents) as a directory of the hub's own: made with `mode` when
    missing; an existing one must belong to the hub and be writable by it alone (else a user could
    swap what lies inside while the hub works there)."""
    if not path.exists():
        path.mkdir(parents=True, exist_ok=True, mode=mode)
        os.chmod(path, mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(
            f"{path} must be a directory of the hub's account, writable by it alone "
            f"(owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})"
        )
