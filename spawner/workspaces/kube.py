"""Workspaces of GPUKubeSpawner: a home PVC per server, VolumeSnapshots of it, restore and clone.

The Kubernetes half of what `workspace.LocalWorkspaceMixin` does on one machine:

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
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException
from tornado import web
from traitlets import Bool, Float, Integer, List, Unicode, default

from gpulab.spawner.kube.objects import (
    CHECKPOINT_KEY_DIR,
    CHECKPOINT_KEY_FIELD,
    CHECKPOINT_KEY_VOLUME,
    SNAPSHOT_GROUP,
    SNAPSHOT_VERSION,
    checkpoint_key_mount,
    checkpoint_key_secret_manifest,
    checkpoint_key_volume,
    dns_name,
    home_pvc_manifest,
    snapshot_name,
    timestamp_slug,
    volume_snapshot_manifest,
    workspace_id,
)
from gpulab.spawner.kube.snapshots import snapshot_listing, snapshots_to_delete
from gpulab.spawner.names import SNAPSHOT_KIND_LABEL, WORKSPACE_LABEL
from gpulab.spawner.singleuser.checkpoint import derive_user_key
from gpulab.spawner.singleuser.checkpoint.environment import persistent_env, server_args
from gpulab.spawner.singleuser.checkpoint.prepare import CONTAINER_KEYS
from gpulab.spawner.singleuser.checkpoint.secret import load_or_create_secret
from gpulab.spawner.singleuser.checkpoint.signing import key_to_text
from gpulab.spawner.workspaces.kube_offer import offered_checkpoints
from gpulab.spawner.workspaces.schedule import SCHEDULED, SnapshotScheduleMixin

#: the key's file in the Secret volume (the Secret's field is projected under this name)
KEY_FILE = f"{CHECKPOINT_KEY_DIR}/{CHECKPOINT_KEY_FIELD}"
HOME_VOLUME = "gpulab-home"
PREEMPTED, NODE_LOST = "preempted", "node-lost"


class WorkspaceTimeout(web.HTTPError):
    def __init__(self, message: str) -> None:
        super().__init__(503, message)


class KubeWorkspaceMixin(SnapshotScheduleMixin):
    """Home PVC, workspace environment, VolumeSnapshots, restore and clone for GPUKubeSpawner."""

    checkpoints = Bool(
        True,
        config=True,
        help="""Keep workspaces: a home PVC per server (packages and conda/venv environments
        installed there survive), kernel variables checkpointed (signed per user) and offered back
        on the next start, a VolumeSnapshot of the home each time the server stops, and automatic
        kernel restore after a preemption or a lost node. Off with upstream `profile_list`.""",
    )
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
    checkpoint_secret_file = Unicode(
        "gpulab-checkpoint-secret",
        config=True,
        help="""File holding the hub secret that per-user checkpoint keys are derived from
        (created with 32 random bytes, mode 0600, on first use; relative to the hub's directory).
        The local spawners use the same file by default, so a user's key is the same on both.""",
    )
    checkpoint_key_secret_name_template = Unicode(
        "gpulab-checkpoint-key-{username}",
        config=True,
        help="""Name of the Secret, one per user in the server's namespace, that carries the
        user's checkpoint signing key into their pods (a read-only volume: the key never appears
        in a pod spec or an environment). The usual KubeSpawner fields expand ({username},
        {user_server}, ...).""",
    )
    checkpoint_grace_seconds = Integer(
        config=True,
        help="""How long the stopping server waits for each kernel's final checkpoint
        (--KernelManager.shutdown_wait_time). Default: half of what `delete_grace_period` leaves
        after the preStop hook.""",
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
    snapshot_keep_last = Integer(5, config=True, help="Snapshots kept per server: the newest N...")
    snapshot_keep_daily = Integer(
        7, config=True, help="...plus the newest of each of the last D days."
    )
    snapshot_timeout_seconds = Float(
        120.0,
        config=True,
        help="""How long a stop, restore or clone waits for a VolumeSnapshot to become ready to
        use, and for a restored PVC to be bound.""",
    )

    #: the server's name when its workspace was created (its checkpoint directory's name)
    workspace_name: str | None = None
    #: label value of this server's snapshots; kept in the state, so a renamed server keeps it
    workspace_label: str | None = None
    #: why the last run ended, when it should bring its kernels back by itself
    gpulab_resume_reason: str | None = None
    #: restore kernel variables without asking on this start (reset after it)
    workspace_auto_restore: bool = False
    _gpulab_started_at: float = 0.0
    _snapshot_api_missing: bool = False

    # -- configuration ------------------------------------------------------------------------

    @property
    def workspaces_enabled(self) -> bool:
        return bool(self.checkpoints) and not getattr(self, "profile_list", None)

    @property
    def workspace_dir_name(self) -> str:
        name = self.name if self.workspace_name is None else self.workspace_name
        return name or "default"

    def _workspace_label(self) -> str:
        if self.workspace_label is None:
            self.workspace_label = workspace_id(self.user.name, self.name)
        return self.workspace_label

    @property
    def custom_api(self) -> CustomObjectsApi:
        return CustomObjectsApi(self.api.api_client)

    def _user_key(self) -> bytes:
        return derive_user_key(load_or_create_secret(self.checkpoint_secret_file), self.user.name)

    def snapshot_store(self) -> str:
        """Where this server's snapshots live: VolumeSnapshots in its namespace, by label."""
        return f"{self.namespace}/volumesnapshots?{WORKSPACE_LABEL}={self._workspace_label()}"

    # -- the pod --------------------------------------------------------------------------------

    def workspace_env(self) -> dict[str, Any]:
        """The server's workspace environment, less what depends on the container's Python
        (PATH, PYTHONPATH, PIP_*), which the prepare step adds inside the pod. The signing key
        is only named: a file of the user's Secret volume (`apply_workspace_to_pod`)."""
        if not self.workspaces_enabled:
            return {}
        env: dict[str, Any] = persistent_env(
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
            volumes.append(
                {"name": HOME_VOLUME, "persistentVolumeClaim": {"claimName": "{pvc_name}"}}
            )
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
            mounts.append({"name": HOME_VOLUME, "mountPath": self.workspace_home})
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

    async def apply_workspace_options(self) -> None:
        """The start's one-shot choices (restore the home from a snapshot, restore kernel
        variables), and the automatic kernel restore after a preemption or a lost node."""
        if not self.workspaces_enabled:
            return
        snapshot_id, restore_kernels = self.workspace_options(self.user_options)  # type: ignore[attr-defined]
        self.forget_workspace_options()  # type: ignore[attr-defined]
        self.workspace_auto_restore = bool(restore_kernels or self.gpulab_resume_reason)
        if self.gpulab_resume_reason:
            self.log.info(
                "Server %s/%s was %s: its kernels restore their variables without asking",
                self.user.name,
                self.name,
                "preempted" if self.gpulab_resume_reason == PREEMPTED else "lost with its node",
            )
        if snapshot_id:
            try:
                await self.restore_workspace(snapshot_id)
            except KeyError:
                raise web.HTTPError(
                    400,
                    f"No snapshot {snapshot_id!r} of server {self.user.name}/{self.name}; "
                    f"GET /hub/api/gpulab/users/{self.user.name}/snapshots lists them",
                ) from None

    def workspace_started(self) -> None:
        """After a successful start: the one-shot choices are spent."""
        self.workspace_auto_restore = False
        self.gpulab_resume_reason = None
        self._gpulab_started_at = time.time()

    def workspace_interrupted(self, reason: str) -> None:
        """The server was stopped by the cluster (preemption, lost node): its next start brings
        the kernels back by itself."""
        self.gpulab_resume_reason = reason

    def was_preempted(self) -> bool:
        """Whether gpulab evicted this server for on-demand work since it started."""
        events = self.gpu_capacity.events_for(self.allocation_id)  # type: ignore[attr-defined]
        return any(
            e["stage"] == "preempted" and e["time"] >= self._gpulab_started_at - 1 for e in events
        )

    # -- state ------------------------------------------------------------------------------

    def workspace_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.workspace_name is not None:
            state["gpulab_workspace"] = self.workspace_name
        if self.workspace_label is not None:
            state["gpulab_workspace_label"] = self.workspace_label
        if self.gpulab_resume_reason:
            state["gpulab_resume_reason"] = self.gpulab_resume_reason
        if self._gpulab_started_at:
            state["gpulab_started_at"] = self._gpulab_started_at
        return state

    def load_workspace_state(self, state: dict[str, Any]) -> None:
        if state.get("gpulab_workspace") is not None:
            self.workspace_name = state["gpulab_workspace"]
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

        orm_spawner.state = self.get_state()  # type: ignore[attr-defined]
        session = inspect(orm_spawner).session
        if session is not None:
            session.commit()

    # -- snapshots ------------------------------------------------------------------------------

    def _snapshot_labels(self, label: str) -> dict[str, str]:
        labels = self._build_common_labels({})  # hub.jupyter.org/username, common_labels
        labels[WORKSPACE_LABEL] = self._workspace_label()
        labels[SNAPSHOT_KIND_LABEL] = dns_name(label, 63)
        return labels

    async def _pvc(self, name: str) -> dict[str, Any] | None:
        try:
            pvc = await self.api.read_namespaced_persistent_volume_claim(name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return self.api.api_client.sanitize_for_serialization(pvc)

    async def _snapshots_raw(self) -> list[dict[str, Any]]:
        try:
            listing = await self.custom_api.list_namespaced_custom_object(
                SNAPSHOT_GROUP,
                SNAPSHOT_VERSION,
                self.namespace,
                "volumesnapshots",
                label_selector=f"{WORKSPACE_LABEL}={self._workspace_label()}",
            )
        except ApiException as e:
            if e.status == 404:
                self._warn_no_snapshot_api()
                return []
            raise
        return list(listing.get("items", []))

    def _warn_no_snapshot_api(self) -> None:
        if not self._snapshot_api_missing:
            self._snapshot_api_missing = True
            self.log.warning(
                "The cluster has no snapshot.storage.k8s.io/v1 API: workspaces of %s are kept "
                "in their PVCs but not snapshotted (install the external-snapshotter CRDs)",
                self.user.name,
            )

    async def _get_volume_snapshot(self, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await self.custom_api.get_namespaced_custom_object(
                SNAPSHOT_GROUP, SNAPSHOT_VERSION, self.namespace, "volumesnapshots", name
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return found

    async def _own_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """This server's ready snapshot `snapshot_id`; KeyError for any other."""
        vs = await self._get_volume_snapshot(snapshot_id)
        labels = ((vs or {}).get("metadata") or {}).get("labels") or {}
        if vs is None or labels.get(WORKSPACE_LABEL) != self._workspace_label():
            raise KeyError(snapshot_id)
        if not (vs.get("status") or {}).get("readyToUse"):
            raise KeyError(snapshot_id)
        return vs

    async def _wait_snapshot_ready(self, name: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.snapshot_timeout_seconds
        while True:
            vs = await self._get_volume_snapshot(name)
            status = (vs or {}).get("status") or {}
            if vs is not None and status.get("readyToUse"):
                return vs
            if time.monotonic() > deadline:
                why = (status.get("error") or {}).get("message") or "no snapshotter answered"
                raise WorkspaceTimeout(
                    f"Snapshot {name} of {self.user.name}/{self.name} is not ready after "
                    f"{self.snapshot_timeout_seconds:.0f} s: {why}"
                )
            await asyncio.sleep(0.3)

    async def snapshot_workspace(
        self, label: str = "on-stop", *, raise_errors: bool = False, retention: bool = True
    ) -> dict[str, Any] | None:
        """A VolumeSnapshot of the server's home PVC, once ready; retention applied after it.
        None when workspaces are off, the server has no PVC yet or the cluster cannot snapshot."""
        if not self.workspaces_enabled or not self._pvc_exists:
            return None
        try:
            if await self._pvc(self.pvc_name) is None:
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
                await self.custom_api.create_namespaced_custom_object(
                    SNAPSHOT_GROUP, SNAPSHOT_VERSION, self.namespace, "volumesnapshots", body
                )
            except ApiException as e:
                if e.status == 404:
                    self._warn_no_snapshot_api()
                    return None
                raise
            vs = await self._wait_snapshot_ready(name)
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
            await self._delete_snapshot(name)
        return doomed

    async def _delete_snapshot(self, name: str) -> None:
        try:
            await self.custom_api.delete_namespaced_custom_object(
                SNAPSHOT_GROUP, SNAPSHOT_VERSION, self.namespace, "volumesnapshots", name
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def snapshot_schedule_wanted(self) -> bool:
        return self.workspaces_enabled

    async def scheduled_snapshot(self) -> None:
        # of a volume in use: crash-consistent, as a CSI snapshot of a running pod's disk is
        await self.snapshot_workspace(SCHEDULED)

    async def take_workspace_snapshot(self, label: str = "on-demand") -> dict[str, Any] | None:
        """A snapshot now (hub API, workspaces page); the server may be running."""
        return await self.snapshot_workspace(label, raise_errors=True)

    async def list_workspace_snapshots(self) -> list[dict[str, Any]]:
        """This server's ready snapshots, newest first."""
        listed = [snapshot_listing(vs) for vs in await self._snapshots_raw()]
        ready = [s for s in listed if s["ready"]]
        return sorted(ready, key=lambda s: (s["created"], s["id"]), reverse=True)

    async def workspace_offer(self) -> dict[str, Any] | None:
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
        try:
            pvc = await self._pvc(self.pvc_name)
            pv_name = ((pvc or {}).get("spec") or {}).get("volumeName")
            if not pv_name:
                return None
            pv = self.api.api_client.sanitize_for_serialization(
                await self.api.read_persistent_volume(pv_name)
            )
        except ApiException:
            return None
        path = ((pv.get("spec") or {}).get("hostPath") or {}).get("path")
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
        body = self._home_pvc(name, snapshot_id)
        try:
            await self.api.create_namespaced_persistent_volume_claim(self.namespace, body)
        except ApiException as e:
            if e.status == 409:
                raise FileExistsError(f"PVC {self.namespace}/{name} already exists") from None
            raise
        deadline = time.monotonic() + self.snapshot_timeout_seconds
        while True:
            pvc = await self._pvc(name)
            if pvc and (pvc.get("status") or {}).get("phase") == "Bound":
                return
            if time.monotonic() > deadline:
                await self._delete_pvc(name)
                raise WorkspaceTimeout(
                    f"The home restored from snapshot {snapshot_id} was not ready after "
                    f"{self.snapshot_timeout_seconds:.0f} s; try again"
                )
            await asyncio.sleep(0.3)

    async def _delete_pvc(self, name: str) -> None:
        try:
            await self.api.delete_namespaced_persistent_volume_claim(name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise

    def _restored_pvc_name(self) -> str:
        base = self._expand_user_properties(self.pvc_name_template)
        return dns_name(f"{base}-{timestamp_slug(time.time())}-{secrets.token_hex(2)}")

    async def restore_workspace(self, snapshot_id: str) -> dict[str, Any]:
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
            await self._delete_pvc(old)
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

    async def clone_workspace(self, snapshot_id: str, target: KubeWorkspaceMixin) -> dict[str, Any]:
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
