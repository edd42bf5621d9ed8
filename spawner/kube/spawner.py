"""GPUKubeSpawner: KubeSpawner with gpulab's profiles, quotas, allocator and preemption.

The shared mixin resolves the profile and checks it against the user's groups; this module maps
the placement to the pod (resources of the configured sharing backend, node affinity, priority
class, tolerations, annotations), keeps the allocator current from watches of the cluster, evicts
preemptible servers for on-demand ones, and notices servers lost with their node. Workspaces
(home PVC per server, its VolumeSnapshots, restore, clone, kernel restore after a preemption or
a lost node) come from `gpulab.spawner.workspaces.kube.KubeWorkspaceMixin`.
Upstream `profile_list` keeps working unchanged: with it set, this is plain KubeSpawner.

Tenant isolation (issue 12), on by default whatever the profiles: every server runs as a fixed
non-root uid/gid with `runAsNonRoot`, no privilege escalation, no capabilities and the runtime's
seccomp profile; the namespace gets the `gpulab-singleuser` NetworkPolicy (`isolation.KubeIsolationMixin`, manifests in `objects`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

from kubernetes_asyncio.client import V1DeleteOptions
from kubernetes_asyncio.client.exceptions import ApiException
from kubespawner import KubeSpawner
from tornado import web
from traitlets import Dict, Float, List, Unicode, default, validate

from gpulab.hub.allocator import NoCapacity, Placement, QuotaExceeded
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.profiles import Profile
from gpulab.spawner.environment import AssignedGPU, Enforcement
from gpulab.spawner.gpu_mixin import GPUSpawnerMixin
from gpulab.spawner.kube.executors import KubeExecutorsMixin
from gpulab.spawner.kube.gpu_resources import (
    ISOLATION,
    SHARING_BACKENDS,
    VISIBLE_DEVICES_ENV,
    PlacedPod,
    container_device_environment,
)
from gpulab.spawner.kube.isolation import KubeIsolationMixin
from gpulab.spawner.kube.objects import (
    placement_annotation,
    placement_from_pod,
    pod_event_manifest,
    prestop_lifecycle,
    priority_class_manifest,
    related_pod_affinity,
    safe_label_value,
)
from gpulab.spawner.kube.placed_pods import gpu_memory_mib, placed_pod_on
from gpulab.spawner.kube.pod_security import pod_security_advice, pod_security_refusal
from gpulab.spawner.kube.state import KubeGPUState, ensure_kube_state
from gpulab.spawner.kube.warm_start import KubeWarmStartMixin
from gpulab.spawner.names import (
    AFFINITY_LABEL,
    PLACEMENT_ANNOTATION,
    PRIORITY_LABEL,
)
from gpulab.spawner.workspaces.kube import NODE_LOST, PREEMPTED, KubeWorkspaceMixin


# warm starts and the job and Dask executors are parts of their own (warm_start, executors); they
# come after KubeIsolationMixin, the first base, so that the options each class lists as its own
# (docs/configuration.md) stay where they were, and before GPUSpawnerMixin, which they build on
class GPUKubeSpawner(
    KubeIsolationMixin,
    KubeWorkspaceMixin,
    KubeWarmStartMixin,
    KubeExecutorsMixin,
    GPUSpawnerMixin,
    KubeSpawner,
):
    """One pod per server, with a whole GPU or a share of one, placed by gpulab's allocator, and
    a home PVC that is snapshotted on every stop."""

    gpu_sharing = Unicode(
        "mig",
        config=True,
        help="""How a fraction of a GPU is enforced on Kubernetes: 'mig' (a MIG slice, hardware
        isolation; needs MIG-partitioned GPUs), 'hami' (HAMi's memory/compute limits) or
        'time-slicing' (NVIDIA device plugin replicas, no isolation). Each states its isolation
        level in the profile picker. Fractions are placed only on the devices nodes advertise
        for this backend (MIG instances per profile, time-slicing replicas, GPUs registered by
        HAMi, in steps of 1/split), so a full backend refuses the next spawn with a 409 instead
        of leaving a pod Pending; a share takes its whole instance or replica.""",
    )

    @validate("gpu_sharing")
    def _check_sharing(self, proposal: Any) -> str:
        if proposal["value"] not in SHARING_BACKENDS:
            raise ValueError(
                f"GPUKubeSpawner.gpu_sharing must be one of {list(SHARING_BACKENDS)}, "
                f"not {proposal['value']!r}"
            )
        return str(proposal["value"])

    priority_classes = Dict(
        {"on-demand": ["gpulab-on-demand", 1000], "preemptible": ["gpulab-preemptible", 100]},
        config=True,
        help="""PriorityClass [name, value] per profile priority; gpulab creates missing ones.
        Preemptible servers are the ones evicted for on-demand work.""",
    )

    node_failure_seconds = Float(
        30.0,
        config=True,
        help="""How long the node of a running server may be NotReady (or gone) before the server
        counts as lost: its pod is force-deleted and its GPU share released, instead of showing as
        running until Kubernetes evicts it minutes later.""",
    )

    affinity_group_template = Unicode(
        "{username}",
        config=True,
        help="""Servers with the same expanded value are related: gpulab places them in one rack
        when it can and asks the scheduler for the same (pod affinity on the rack, then the zone).
        The default groups each user's servers; empty turns it off.""",
    )

    @property
    def gpulab_affinity_group(self) -> str | None:  # type: ignore[override]
        if not self.affinity_group_template:
            return None
        return self.affinity_group_template.format(username=self.user.name, servername=self.name)

    @default("delete_grace_period")
    def _default_grace(self) -> int:
        # long enough for the kernel-state checkpoint to be written on SIGTERM
        return 60

    # workspaces: one home PVC per server (KubeSpawner's storage options, gpulab's defaults)
    @default("pvc_name_template")
    def _default_pvc_name_template(self) -> str:
        return "gpulab-home-{user_server}"

    @default("storage_pvc_ensure")
    def _default_storage_pvc_ensure(self) -> bool:
        return bool(self.checkpoints and not self.profile_list)

    @default("storage_capacity")
    def _default_storage_capacity(self) -> str:
        return "10Gi"

    prestop_command = List(
        ["python3", "-m", "gpulab.spawner.singleuser.prestop"],
        config=True,
        help="""preStop hook of server pods (the image must have gpulab installed): it makes this
        server's kernels write their final checkpoint before Kubernetes stops the server. It gets
        `--timeout <delete_grace_period - 5>`. Empty: no hook.""",
    )

    @default("lifecycle_hooks")
    def _default_lifecycle_hooks(self) -> dict[str, Any]:
        return prestop_lifecycle(self.prestop_command, max(1, self.delete_grace_period - 5))

    _priority_classes_ready: ClassVar[bool] = False

    # -- configuration glue --------------------------------------------------------------------

    @default("options_form")
    def _gpulab_kube_options_form(self) -> Any:
        if self.profile_list:
            return KubeSpawner._options_form_default(self)
        return self.gpulab_options_form

    @default("options_from_form")
    def _gpulab_kube_options_from_form(self) -> Any:
        if self.profile_list:
            return self._options_from_form
        return self.gpulab_options_from_form

    @classmethod
    def chooses_gpulab_profiles(cls, config: Any) -> bool:
        # upstream profile_list: KubeSpawner picks its own default and refuses gpulab's slugs
        return not cls.class_setting(config, "profile_list", [])

    def gpulab_apply_user_options(self, user_options: Any) -> None:
        if self.profile_list:
            return  # upstream profile_list: KubeSpawner validates in load_user_options
        super().gpulab_apply_user_options(user_options)

    def describe_enforcement(self, gpus: list[AssignedGPU]) -> Enforcement:
        if not gpus:
            return Enforcement("cpu-only", ISOLATION["cpu"])
        if all(g.milli == 1000 for g in gpus):
            return Enforcement("exclusive", ISOLATION["whole"])
        return Enforcement(self.gpu_sharing, ISOLATION[self.gpu_sharing])

    # -- cluster state -------------------------------------------------------------------------

    async def gpu_state(self) -> KubeGPUState:
        state = await ensure_kube_state(self.gpu_capacity, sharing=self.gpu_sharing)
        cls = type(self)
        if not cls._priority_classes_ready:
            await self._ensure_priority_classes()
            cls._priority_classes_ready = True
        return state

    async def _ensure_priority_classes(self) -> None:
        from kubernetes_asyncio.client import SchedulingV1Api

        api = SchedulingV1Api(self.api.api_client)
        for priority, (name, value) in self.priority_classes.items():
            body = priority_class_manifest(name, int(value), priority)
            try:
                await api.create_priority_class(body)
            except ApiException as e:
                if e.status != 409:
                    raise

    # -- start ---------------------------------------------------------------------------------

    def _gpu_memory_mib(self, placement: Placement) -> int:
        try:
            return gpu_memory_mib(self.gpu_capacity, placement)
        except ValueError as e:
            raise web.HTTPError(409, str(e)) from None

    async def _place(self, profile: Profile) -> Placement:
        """Allocate, evicting preemptible servers when an on-demand request does not fit."""
        capacity = self.gpu_capacity
        request = self.gpulab_request(profile)
        try:
            return await self.gpulab_allocate(profile)
        except web.HTTPError as e:
            if (
                e.status_code != 409
                or profile.priority != "on-demand"
                or not capacity.fits_inventory(profile)  # no eviction makes room for that
            ):
                raise
        try:
            placement, victims = await asyncio.to_thread(
                capacity.allocator.preempt_and_place, request
            )
        except (NoCapacity, QuotaExceeded):
            raise web.HTTPError(
                409,
                f"Profile {profile.display_name!r} cannot start now: no GPUs are free and no "
                "preemptible server can make room",
            ) from None
        for victim in victims:
            await self._evict(victim, reason=f"preempted for on-demand server {request.id}")
        self.gpulab_placement = placement
        return placement

    async def _evict(self, victim: Placement, reason: str) -> None:
        if await self.gpu_capacity.evict(victim, reason):
            return  # a job run: its owner (the job service) stops it and queues it again
        state = await self.gpu_state()
        message = (
            f"Your server {victim.request.id} was stopped at {time.strftime('%H:%M')}: {reason}"
        )
        self.gpu_capacity.record_event(victim.request.id, "preempted", message)
        self.gpu_capacity.record_notice(victim.request.owner, message)
        for key, pod in list(state.pods.objects.items()):
            held = placement_from_pod(pod)
            if held is None or held.request.id != victim.request.id:
                continue
            namespace, name = key.split("/", 1)
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            self.log.warning("Evicting %s (%s): %s", key, victim.request.id, reason)
            await self._record_pod_event(pod, "Preempted", reason)
            try:
                await self.api.delete_namespaced_pod(
                    name, namespace, body=V1DeleteOptions(grace_period_seconds=grace)
                )
            except ApiException as e:
                if e.status != 404:
                    raise

    async def _record_pod_event(self, pod: dict[str, Any], reason: str, message: str) -> None:
        meta = pod["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event = pod_event_manifest(pod, reason, message, now)
        try:
            await self.api.create_namespaced_event(meta["namespace"], event)
        except ApiException as e:
            self.log.warning("could not record event on %s: %s", meta["name"], e)

    def _placed_pod(self, profile: Profile, placement: Placement, priority: str) -> PlacedPod:
        self._gpu_memory_mib(placement)  # an unknown model: a 409 with its words
        return placed_pod_on(
            self.gpu_capacity,
            profile,
            placement,
            sharing=self.gpu_sharing,
            priority=priority,
            priority_classes={p: v[0] for p, v in self.priority_classes.items()},
        )

    @property
    def job_python(self) -> str:
        """The image's Python that runs a job's wrapper and its .py scripts: the one that
        prepares the server's home (`workspace_prepare_command`), which has gpulab installed,
        as the job wrapper needs; python3 when that command is off."""
        command = list(self.workspace_prepare_command)
        return str(command[0]) if command else "python3"

    def placed_job_pod(self, profile: Profile, placement: Placement) -> PlacedPod:
        """The pod side of a job's placement, as a server's on it (the job's own priority: a
        preemptible job may run on an on-demand profile)."""
        return self._placed_pod(profile, placement, placement.request.priority)

    def _apply_placement(self, profile: Profile, placement: Placement) -> None:
        pod = self._placed_pod(profile, placement, profile.priority)
        spec = pod.gpu
        self.extra_resource_limits = {**self.extra_resource_limits, **spec.limits}
        self.extra_resource_guarantees = {**self.extra_resource_guarantees, **spec.limits}
        self.node_affinity_required = [
            *self._sorted_dict_values(self.node_affinity_required),
            *spec.node_affinity_required,
        ]
        self.tolerations = [*self._sorted_dict_values(self.tolerations), *spec.tolerations]
        self.priority_class_name = spec.priority_class_name
        if profile.cpu_limit:
            self.cpu_limit = self.cpu_guarantee = profile.cpu_limit
        if profile.mem_limit_mib:
            self.mem_limit = self.mem_guarantee = profile.mem_limit_mib * 1024 * 1024
        self.extra_annotations = {
            **self.extra_annotations,
            # KubeSpawner expands {templates} in annotations: escape the JSON's braces
            PLACEMENT_ANNOTATION: placement_annotation(placement)
            .replace("{", "{{")
            .replace("}", "}}"),
        }
        self.extra_labels = {**self.extra_labels, PRIORITY_LABEL: profile.priority}
        group = self.gpulab_affinity_group
        if group:
            self.extra_labels[AFFINITY_LABEL] = safe_label_value(group)
            self.pod_affinity_preferred = [
                *self._sorted_dict_values(self.pod_affinity_preferred),
                *related_pod_affinity(safe_label_value(group)),
            ]
        self.environment = {**self.environment, **pod.environment}
        self.gpulab_enforcement = self.describe_enforcement(
            [AssignedGPU(s.uuid, "", 0, s.milli) for s in placement.gpus]
        )

    async def load_user_options(self) -> None:
        if self.profile_list:
            await super().load_user_options()
            return
        profile = self.gpulab_profile or self.resolve_profile(self.user_options)
        self.gpulab_profile = profile
        await self.apply_workspace_options()  # a restore from a snapshot, before any allocation
        await self.gpu_state()
        placement = await self._claim_warm(profile)
        if placement is None:
            placement = await self._place(profile)
        self._apply_placement(profile, placement)
        self.apply_workspace_to_pod()

    def get_env(self) -> dict[str, Any]:
        env: dict[str, Any] = super().get_env()
        env.update(self.workspace_env(env))
        if self.profile_list:
            return env  # plain KubeSpawner: its profiles say what a pod sees
        # last, over the `environment` config: the placement alone decides the devices
        placement = self.gpulab_placement
        holds_gpus = placement is not None and bool(placement.gpus)
        if holds_gpus and VISIBLE_DEVICES_ENV in env:
            self.log.warning(
                "Ignoring %s=%r in %s's environment: the device plugin names the devices of "
                "the share",
                VISIBLE_DEVICES_ENV,
                env[VISIBLE_DEVICES_ENV],
                self._log_name,
            )
        return container_device_environment(env, holds_gpus=holds_gpus)

    def get_args(self) -> list[str]:
        return [*super().get_args(), *self.workspace_args()]

    async def get_pod_manifest(self) -> Any:
        await self.ensure_checkpoint_key_secret()  # after KubeSpawner ensured the namespace
        await self.ensure_network_policy()  # before the pod: it is never up unprotected
        pod = self.harden_pod_containers(await super().get_pod_manifest())
        return self.wrap_container_command(pod)

    async def _start(self) -> Any:
        try:
            try:
                url = await super()._start()
            except ApiException as e:
                refusal = pod_security_refusal(e.status, e.body)
                if refusal is None:
                    raise
                raise web.HTTPError(500, pod_security_advice(refusal, self.namespace)) from None
        except BaseException:
            if not self.profile_list:
                await self.gpulab_release()
            raise
        self.workspace_started()
        self._gpulab_running = True
        self.start_snapshot_schedule()
        return url

    # -- running, stopping, lost nodes --------------------------------------------------------

    async def poll(self) -> int | None:
        status = await super().poll()
        if self.profile_list:
            return status
        state = await self.gpu_state()
        if status is None:
            pod = (
                self.pod_reflector.pods.get(self.pod_reflector_key) if self.pod_reflector else None
            )
            node = ((pod or {}).get("spec") or {}).get("nodeName")
            if node and state.node_failed_for(node) > self.node_failure_seconds:
                self.log.warning(
                    "Node %s of %s is lost; removing its pod and releasing its GPUs",
                    node,
                    self.pod_name,
                )
                self.gpu_capacity.record_notice(
                    self.user.name, f"Your server {self.allocation_id} was lost with node {node}"
                )
                try:
                    await self.api.delete_namespaced_pod(
                        self.pod_name, self.namespace, body=V1DeleteOptions(grace_period_seconds=0)
                    )
                except ApiException as e:
                    if e.status != 404:
                        raise
                await self.gpulab_release()
                self._gpulab_running = False
                self.stop_snapshot_schedule()
                self.workspace_interrupted(NODE_LOST)
                await self.snapshot_workspace(label=NODE_LOST)
                return 1
            self._gpulab_node = node
            self._gpulab_running = True
            if self.gpulab_placement is None:
                self.restore_placement()
            if not self.snapshot_schedule_running:  # e.g. found running after a hub restart
                self.start_snapshot_schedule()
        else:
            # the pod is gone: stopped, evicted (the allocator already gave its GPUs away) or lost
            self.stop_snapshot_schedule()
            was_running, self._gpulab_running = self._gpulab_running, False
            if self.gpu_capacity.allocator.get(self.allocation_id) is not None:
                await self.gpulab_release()
            if was_running and not self._stop_pending:  # a stop takes its own snapshot
                reason = self._interruption(state)
                await self.snapshot_workspace(label=reason or "after-exit")
        return status

    #: a pod of this server ran since the last stop (so its end is worth a snapshot)
    _gpulab_running: bool = False

    def _interruption(self, state: KubeGPUState) -> str | None:
        """Whether the server's end was a preemption or its node's failure (then its next start
        restores the kernels by itself); None for a stop or an exit of its own."""
        node = self._gpulab_node
        if self.was_preempted():
            reason = PREEMPTED
        elif node and state.node_failed_for(node) > 0:
            reason = NODE_LOST
        else:
            return None
        self.workspace_interrupted(reason)
        return reason

    _gpulab_node: str | None = None

    def was_preempted(self) -> bool:
        """Whether gpulab evicted this server for on-demand work since it started."""
        events = self.gpu_capacity.events_for(self.allocation_id)
        return any(
            e["stage"] == "preempted" and e["time"] >= self._gpulab_started_at - 1 for e in events
        )

    @property
    def pod_reflector_key(self) -> str:
        return f"{self.namespace}/{self.pod_name}"

    async def stop(self, now: bool = False) -> None:
        self.stop_snapshot_schedule()
        try:
            await super().stop(now=now)
        finally:
            if not self.profile_list:
                await self.gpulab_release()
        self._gpulab_running = False
        if self.workspaces_enabled:
            # the pod is gone: a consistent snapshot of the home (KubeSpawner's poll also calls
            # stop() for a pod whose server exited, e.g. while it was being preempted)
            reason = self._interruption(await self.gpu_state())
            await self.snapshot_workspace(label=reason or "on-stop")

    # -- state -----------------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        state.update(self.workspace_state())
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.load_workspace_state(state)


# the hub's GPUCapacity keeps a Kubernetes inventory current through this module's cluster view; it
# registers here, on import, so the hub never imports the spawner package (JupyterHub imports its
# spawner_class while loading the config, before any request reaches GPUCapacity.ready())
GPUCapacity.register_inventory_source("kubernetes", ensure_kube_state)
