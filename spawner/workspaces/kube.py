"""Workspaces of GPUKubeSpawner: a home PVC per server, VolumeSnapshots of it, restore and clone.

The Kubernetes half of what `workspaces.local.LocalWorkspaceMixin` does on one machine (both
implement `gpulab.hub.workspaces.Workspaces` and share `workspaces.base.WorkspaceSpawnerMixin`):

- each server (user + named server) has its own home PVC (KubeSpawner's `storage_pvc_ensure`,
  `pvc_name_template` = `gpulab-home-{user_server}`), mounted at `workspace_home`; its name is
  kept in the spawner's state, so a restarted hub or a changed template still finds it;
- the pod gets the local backend's workspace environment (`persistent_env`: HOME, the package
  and environment locations, the kernel checkpoint directory; the user's signing key as a file
  of a per-user Secret mounted read-only, never in the pod spec or an environment) and its command starts
  with `python3 -m gpulab.spawner.singleuser.checkpoint.prepare`, which prepares the home inside the
  container (the hub cannot write into the volume) and execs the server;
- every stop, and every `snapshot_interval_seconds` while the server runs, takes a
  VolumeSnapshot of the PVC (`<pvc>-<time>-<token>`, labelled with the workspace), retention as
  on the local backend; snapshots are listed, restored (a new PVC with
  the snapshot as its `dataSource`, the current one kept as a 'before-restore' snapshot and then
  deleted) and cloned into a new named server's PVC;
- a server stopped by a preemption or the loss of its node restores its kernels' variables
  without asking on its next start (GPULAB_AUTO_RESTORE=1, once).

Needs the snapshot.storage.k8s.io/v1 API and a VolumeSnapshotClass for the PVCs' driver (the dev
cluster has both: class `gpulab-local`); without them homes still persist, and snapshots are
skipped with a warning.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from traitlets import Float, List, Unicode, default

from gpulab.spawner.kube.objects import (
    CHECKPOINT_KEY_DIR,
    CHECKPOINT_KEY_FIELD,
    CHECKPOINT_KEY_VOLUME,
    HOME_VOLUME,
    checkpoint_key_mount,
    checkpoint_key_secret_manifest,
    checkpoint_key_volume,
    dns_name,
    home_mount,
    home_pvc_manifest,
    home_volume,
    snapshot_name,
    timestamp_slug,
    volume_snapshot_manifest,
    workspace_id,
)
from gpulab.spawner.kube.snapshots import snapshot_listing, snapshots_to_delete
from gpulab.spawner.names import SNAPSHOT_KIND_LABEL, WORKSPACE_LABEL
from gpulab.spawner.singleuser.checkpoint.environment import persistent_env, server_args
from gpulab.spawner.singleuser.checkpoint.prepare import CONTAINER_KEYS
from gpulab.spawner.singleuser.checkpoint.signing import key_to_text
from gpulab.spawner.workspaces.base import (
    CloneResult,
    RestoreResult,
    SnapshotListing,
    WorkspaceOffer,
    WorkspaceSpawnerMixin,
)
from gpulab.spawner.workspaces.kube_offer import offered_checkpoints
from gpulab.spawner.workspaces.kube_volumes import NoSnapshotAPI, WorkspaceVolumes
from gpulab.spawner.workspaces.schedule import SCHEDULED

#: the key's file in the Secret volume (the Secret's field is projected under this name)
KEY_FILE = f"{CHECKPOINT_KEY_DIR}/{CHECKPOINT_KEY_FIELD}"
PREEMPTED, NODE_LOST = "preempted", "node-lost"


class KubeWorkspaceMixin(WorkspaceSpawnerMixin):
    """Home PVC, workspace environment, VolumeSnapshots, restore and clone for GPUKubeSpawner:
    its implementation of `gpulab.hub.workspaces.Workspaces`."""

    workspace_home = Unicode(
        "/home/jovyan",
        config=True,
        help="Where the server's home PVC is mounted in the pod (its HOME and working directory).",
    )
    workspace_prepare_command = List(
        ["python3", "-m", "gpulab.spawner.singleuser.checkpoint.prepare"],
        config=True,
        help="""Prefix of the server container's command that prepares the home inside the pod
        (the image must have gpulab installed): it gets `--home <workspace_home> --` and the
        server's command. Empty: the home is not prepared (kernels then lack the checkpoint
        extension unless the image loads it).""",
    )
    checkpoint_key_secret_name_template = Unicode(
        "gpulab-checkpoint-key-{username}",
        config=True,
        help="""Name of the Secret, one per user in the server's namespace, that carries the
        user's checkpoint signing key into their pods (a read-only volume: the key never appears
        in a pod spec or an environment). The usual KubeSpawner fields expand ({username},
        {user_server}, ...).""",
    )

    @default("checkpoint_grace_seconds")
    def _default_checkpoint_grace(self) -> int:
        return max(1, (int(getattr(self, "delete_grace_period", 30)) - 5) // 2)

    volume_snapshot_class = Unicode(
        "",
        config=True,
        help="""VolumeSnapshotClass of the home snapshots; empty: the cluster's default class for
        the PVC's driver (on the dev cluster: `gpulab-local`).""",
    )
    snapshot_timeout_seconds = Float(
        120.0,
        config=True,
        help="""How long a stop, restore or clone waits for a VolumeSnapshot to become ready to
        use, and for a restored PVC to be bound.""",
    )

    #: label value of this server's snapshots; kept in the state, so a renamed server keeps it
    workspace_label: str | None = None
    #: why the last run ended, when it should bring its kernels back by itself
    gpulab_resume_reason: str | None = None
    _gpulab_started_at: float = 0.0
    _snapshot_api_missing: bool = False

    # -- configuration ------------------------------------------------------------------------

    @property
    def workspaces_enabled(self) -> bool:
        return bool(self.checkpoints) and not getattr(self, "profile_list", None)

    def workspace_home_id(self) -> str:
        # the home PVC (kept in the state); a clone's PVC is its own although the clone keeps
        # the source's directory names inside
        return str(self.pvc_name or self.workspace_dir_name)

    def _workspace_label(self) -> str:
        if self.workspace_label is None:
            self.workspace_label = workspace_id(self.user.name, self.name)
        return self.workspace_label

    @property
    def workspace_volumes(self) -> WorkspaceVolumes:
        """The PVC and VolumeSnapshot calls, in this server's namespace."""
        return WorkspaceVolumes(self.api, self.namespace, self.snapshot_timeout_seconds)

    def snapshot_store(self) -> str:
        """Where this server's snapshots live: VolumeSnapshots in its namespace, by label."""
        return f"{self.namespace}/volumesnapshots?{WORKSPACE_LABEL}={self._workspace_label()}"

    # -- the pod --------------------------------------------------------------------------------

    def workspace_env(self, base_env: Mapping[str, str]) -> dict[str, str]:
        """The server's workspace environment, less what depends on the container's Python
        (PATH, PYTHONPATH, PIP_*), which the prepare step adds inside the pod: so `base_env`,
        the hub's view of the pod's environment, is not read. The signing key is only named: a
        file of the user's Secret volume (`apply_workspace_to_pod`)."""
        if not self.workspaces_enabled:
            return {}
        env = persistent_env(
            Path(self.workspace_home),
            server=self.workspace_dir_name,
            base_env={},
            user=self.user.name,
            auto_restore=self.workspace_auto_restore,
            # the path only: another tenant's pod neither mounts this Secret nor can read the
            # kubelet's copy of it, and user code finds no key in any environment to replay
            key_file=KEY_FILE,
        )
        return {k: v for k, v in env.items() if k not in CONTAINER_KEYS}

    def checkpoint_key_secret_name(self) -> str:
        return dns_name(self._expand_user_properties(self.checkpoint_key_secret_name_template))

    async def ensure_checkpoint_key_secret(self) -> None:
        """Create the user's key Secret, or bring it up to date (a new hub secret file)."""
        if not self.workspaces_enabled:
            return
        name = self.checkpoint_key_secret_name()
        body = checkpoint_key_secret_manifest(
            name,
            key_to_text(self._user_key()),
            labels={**self._build_common_labels({}), "component": "gpulab-checkpoint-key"},
            annotations={"hub.jupyter.org/username": self.user.name},
        )
        try:
            current = await self.api.read_namespaced_secret(name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            try:
                await self.api.create_namespaced_secret(self.namespace, body)
            except ApiException as e:
                if e.status != 409:  # another of the user's servers created it meanwhile
                    raise
            return
        if (current.data or {}).get(CHECKPOINT_KEY_FIELD) != body["data"][CHECKPOINT_KEY_FIELD]:
            await self.api.replace_namespaced_secret(name, self.namespace, body)

    def workspace_args(self) -> list[str]:
        return server_args(self.checkpoint_grace_seconds) if self.workspaces_enabled else []

    def apply_workspace_to_pod(self) -> None:
        """Mount the home PVC at workspace_home (once, whatever pvc_name is at manifest time)
        and the user's checkpoint key Secret, read-only, at CHECKPOINT_KEY_DIR."""
        if not self.workspaces_enabled:
            return
        self.storage_pvc_ensure = True
        self._workspace_label()
        if self.workspace_name is None:
            self.workspace_name = self.name
        volumes = list(self._sorted_dict_values(self.volumes))  # a copy: never the config's list
        names = {v.get("name") for v in volumes}
        if HOME_VOLUME not in names:
            volumes.append(home_volume("{pvc_name}"))  # KubeSpawner expands {pvc_name}
        if CHECKPOINT_KEY_VOLUME not in names:
            volumes.append(
                checkpoint_key_volume(
                    self.checkpoint_key_secret_name(), CHECKPOINT_KEY_FIELD, CHECKPOINT_KEY_FIELD
                )
            )
        self.volumes = volumes
        mounts = list(self._sorted_dict_values(self.volume_mounts))
        mounted = {m.get("name") for m in mounts}
        if HOME_VOLUME not in mounted:
            mounts.append(home_mount(self.workspace_home))
        if CHECKPOINT_KEY_VOLUME not in mounted:
            mounts.append(checkpoint_key_mount())
        self.volume_mounts = mounts
        if not self.working_dir:
            self.working_dir = self.workspace_home
        self.storage_extra_labels = {
            **self.storage_extra_labels,
            WORKSPACE_LABEL: self._workspace_label(),
        }

    def wrap_container_command(self, pod: Any) -> Any:
        """The server container's command, prefixed with the in-pod home preparation."""
        if not self.workspaces_enabled or not self.workspace_prepare_command:
            return pod
        container = pod.spec.containers[0]
        command = list(container.command or []) + list(container.args or [])
        if not command:
            self.log.warning(
                "Server %s/%s: no command to prefix with the workspace preparation (set "
                "GPUKubeSpawner.cmd); its home is not prepared",
                self.user.name,
                self.name,
            )
            return pod
        container.command = None
        container.args = [
            *self.workspace_prepare_command,
            "--home",
            self.workspace_home,
            "--",
            *command,
        ]
        return pod

    # -- start and stop hooks -----------------------------------------------------------------

    def workspace_started(self) -> None:
        """After a successful start: the one-shot choices are spent."""
        self.workspace_auto_restore = False
        self.gpulab_resume_reason = None
        self._gpulab_started_at = time.time()

    def resume_reason(self) -> str | None:
        return {PREEMPTED: "preempted", NODE_LOST: "lost with its node"}.get(
            self.gpulab_resume_reason or "", self.gpulab_resume_reason
        )

    def workspace_interrupted(self, reason: str) -> None:
        """The server was stopped by the cluster (preemption, lost node): its next start brings
        the kernels back by itself."""
        self.gpulab_resume_reason = reason

    # -- state ------------------------------------------------------------------------------

    def workspace_state(self) -> dict[str, Any]:
        state = super().workspace_state()
        if self.workspace_label is not None:
            state["gpulab_workspace_label"] = self.workspace_label
        if self.gpulab_resume_reason:
            state["gpulab_resume_reason"] = self.gpulab_resume_reason
        if self._gpulab_started_at:
            state["gpulab_started_at"] = self._gpulab_started_at
        return state

    def load_workspace_state(self, state: Mapping[str, Any]) -> None:
        super().load_workspace_state(state)
        if state.get("gpulab_workspace_label"):
            self.workspace_label = state["gpulab_workspace_label"]
        self.gpulab_resume_reason = state.get("gpulab_resume_reason") or None
        self._gpulab_started_at = float(state.get("gpulab_started_at") or 0.0)

    def persist_state(self) -> None:
        """Write the state to the hub's database now (the PVC name changed while stopped)."""
        orm_spawner = getattr(self, "orm_spawner", None)
        if orm_spawner is None:
            return
        from sqlalchemy import inspect

        orm_spawner.state = self.get_state()
        session = inspect(orm_spawner).session
        if session is not None:
            session.commit()

    # -- snapshots ------------------------------------------------------------------------------

    def _snapshot_labels(self, label: str) -> dict[str, str]:
        labels = self._build_common_labels({})  # hub.jupyter.org/username, common_labels
        labels[WORKSPACE_LABEL] = self._workspace_label()
        labels[SNAPSHOT_KIND_LABEL] = dns_name(label, 63)
        return labels

    async def _snapshots_raw(self) -> list[dict[str, Any]]:
        try:
            return await self.workspace_volumes.snapshots(
                f"{WORKSPACE_LABEL}={self._workspace_label()}"
            )
        except NoSnapshotAPI:
            self._warn_no_snapshot_api()
            return []

    def _warn_no_snapshot_api(self) -> None:
        if not self._snapshot_api_missing:
            self._snapshot_api_missing = True
            self.log.warning(
                "The cluster has no snapshot.storage.k8s.io/v1 API: workspaces of %s are kept "
                "in their PVCs but not snapshotted (install the external-snapshotter CRDs)",
                self.user.name,
            )

    async def _own_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """This server's ready snapshot `snapshot_id`; KeyError for any other."""
        vs = await self.workspace_volumes.snapshot(snapshot_id)
        labels = ((vs or {}).get("metadata") or {}).get("labels") or {}
        if vs is None or labels.get(WORKSPACE_LABEL) != self._workspace_label():
            raise KeyError(snapshot_id)
        if not (vs.get("status") or {}).get("readyToUse"):
            raise KeyError(snapshot_id)
        return vs

    async def snapshot_workspace(
        self, label: str = "on-stop", *, raise_errors: bool = False, retention: bool = True
    ) -> SnapshotListing | None:
        """A VolumeSnapshot of the server's home PVC, once ready; retention applied after it.
        None when workspaces are off, the server has no PVC yet or the cluster cannot snapshot."""
        if not self.workspaces_enabled or not self._pvc_exists:
            return None
        try:
            if await self.workspace_volumes.pvc(self.pvc_name) is None:
                return None
            name = snapshot_name(self.pvc_name, time.time(), secrets.token_hex(3))
            body = volume_snapshot_manifest(
                name,
                self.pvc_name,
                snapshot_class=self.volume_snapshot_class,
                labels=self._snapshot_labels(label),
                annotations={
                    "hub.jupyter.org/username": self.user.name,
                    "hub.jupyter.org/servername": self.name,
                },
            )
            try:
                await self.workspace_volumes.create_snapshot(body)
            except NoSnapshotAPI:
                self._warn_no_snapshot_api()
                return None
            vs = await self.workspace_volumes.wait_snapshot_ready(
                name, f"{self.user.name}/{self.name}"
            )
            self.log.info(
                "Snapshot %s (%s) of %s/%s's home %s",
                name,
                label,
                self.user.name,
                self.name,
                self.pvc_name,
            )
            if retention:
                await self.apply_snapshot_retention()
            return snapshot_listing(vs)
        except Exception:
            if raise_errors:
                raise
            self.log.exception(
                "Snapshot of %s/%s's home %s failed", self.user.name, self.name, self.pvc_name
            )
            return None

    async def apply_snapshot_retention(self) -> list[str]:
        ready = [snapshot_listing(vs) for vs in await self._snapshots_raw()]
        ready = [s for s in ready if s["ready"]]
        doomed = snapshots_to_delete(
            ready, keep_last=self.snapshot_keep_last, keep_daily=self.snapshot_keep_daily
        )
        for name in doomed:
            await self.workspace_volumes.delete_snapshot(name)
        return doomed

    def snapshot_schedule_wanted(self) -> bool:
        return self.workspaces_enabled

    async def scheduled_snapshot(self) -> None:
        # of a volume in use: crash-consistent, as a CSI snapshot of a running pod's disk is
        await self.snapshot_workspace(SCHEDULED)

    async def list_workspace_snapshots(self) -> list[SnapshotListing]:
        """This server's ready snapshots, newest first."""
        listed = [snapshot_listing(vs) for vs in await self._snapshots_raw()]
        ready = [s for s in listed if s["ready"]]
        return sorted(ready, key=lambda s: (s["created"], s["id"]), reverse=True)

    async def workspace_offer(self) -> WorkspaceOffer | None:
        """What the picker offers before a start: the home snapshots, and the kernel checkpoints
        when the hub can read the volume (a hostPath PV on the hub's machine, as on the dev
        cluster; elsewhere the kernels offer their checkpoint themselves)."""
        if not self.workspaces_enabled:
            return None
        kernels: list[dict[str, Any]] = []
        volume = await self._readable_volume()
        if volume is not None:
            # the volume's names are the user's: read without following links (see the module)
            found = await asyncio.to_thread(
                offered_checkpoints,
                volume,
                (".gpulab", "checkpoints", self.workspace_dir_name),
                self._user_key(),
                self.user.name,
            )
            kernels = [
                {
                    "notebook": slot,
                    "offer": m.describe(),
                    "variables": m.count,
                    "bytes": m.data_bytes,
                }
                for slot, m in found.items()
            ]
        return {"kernels": kernels, "snapshots": await self.list_workspace_snapshots()}

    async def _readable_volume(self) -> Path | None:
        """The folder of the home claim's PV when it is a hostPath on the hub's machine."""
        if not self._pvc_exists:
            return None
        path = await self.workspace_volumes.host_path_of(self.pvc_name)
        return Path(path) if path else None

    # -- restore and clone ----------------------------------------------------------------------

    def _home_pvc(self, name: str, from_snapshot: str | None) -> dict[str, Any]:
        base = self.api.api_client.sanitize_for_serialization(self.get_pvc_manifest())
        return home_pvc_manifest(
            name,
            storage=self.storage_capacity,
            storage_class=(base.get("spec") or {}).get("storageClassName"),
            access_modes=self.storage_access_modes,
            labels={
                **(base["metadata"].get("labels") or {}),
                WORKSPACE_LABEL: self._workspace_label(),
            },
            annotations=base["metadata"].get("annotations") or {},
            selector=(base.get("spec") or {}).get("selector"),
            from_snapshot=from_snapshot,
        )

    async def _create_pvc_from_snapshot(self, name: str, snapshot_id: str) -> None:
        """Create PVC `name` from the snapshot and wait until it is bound (its data copied).
        FileExistsError when a PVC of that name exists."""
        await self.workspace_volumes.create_bound_pvc(
            self._home_pvc(name, snapshot_id), f"The home restored from snapshot {snapshot_id}"
        )

    def _restored_pvc_name(self) -> str:
        base = self._expand_user_properties(self.pvc_name_template)
        return dns_name(f"{base}-{timestamp_slug(time.time())}-{secrets.token_hex(2)}")

    async def restore_workspace(self, snapshot_id: str) -> RestoreResult:
        """Give the (stopped) server a home as it was in `snapshot_id`: a new PVC from the
        snapshot; the current home is kept as a 'before-restore' snapshot, then its PVC deleted.
        KeyError: no such snapshot of this server."""
        await self._own_snapshot(snapshot_id)
        before = await self.snapshot_workspace("before-restore", raise_errors=True, retention=False)
        old = self.pvc_name if self._pvc_exists else None
        new = self._restored_pvc_name()
        await self._create_pvc_from_snapshot(new, snapshot_id)
        self.pvc_name, self._pvc_exists = new, True
        self.persist_state()
        if old and old != new:
            await self.workspace_volumes.delete_pvc(old)
        await self.apply_snapshot_retention()
        self.log.info(
            "Restored %s/%s's home to snapshot %s (PVC %s, was %s)",
            self.user.name,
            self.name,
            snapshot_id,
            new,
            old,
        )
        return {"restored": snapshot_id, "before_restore": before["id"] if before else None}

    async def clone_workspace(self, snapshot_id: str, target: KubeWorkspaceMixin) -> CloneResult:
        """Give `target` (a new, never started server of the same user) a home PVC with the
        content of this server's snapshot `snapshot_id`, kernel checkpoints included. KeyError:
        no such snapshot; FileExistsError: the target already has a home."""
        await self._own_snapshot(snapshot_id)
        if target._pvc_exists:
            raise FileExistsError(f"server {target.name!r} already has the PVC {target.pvc_name}")
        target.namespace = self.namespace  # a dataSource must be in the claim's namespace
        name = target._expand_user_properties(target.pvc_name_template)
        await target._create_pvc_from_snapshot(name, snapshot_id)
        target.pvc_name, target._pvc_exists = name, True
        # the clone's checkpoints are in the directory of the server they were taken from
        target.workspace_name = self.workspace_dir_name
        target._workspace_label()
        self.log.info(
            "Cloned %s's snapshot %s of server %r into server %r (PVC %s)",
            self.user.name,
            snapshot_id,
            self.name,
            target.name,
            name,
        )
        return {"cloned": snapshot_id, "server": target.name}
