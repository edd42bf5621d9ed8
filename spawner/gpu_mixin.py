"""What every gpulab spawner shares: profile choice -> validated request -> allocation -> release.

The local spawner and the Kubernetes spawner both inherit this mixin; only how a placement is
applied (environment of a process, or a pod manifest) differs between them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from traitlets import Integer, Unicode, default
from traitlets.config import Configurable

from gpulab.hub.allocator import (
    AllocationError,
    AlreadyAllocated,
    InvalidRequest,
    NoCapacity,
    Placement,
    QuotaExceeded,
    Request,
)
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.capacity_catalog import HourBudgetStanding
from gpulab.hub.profiles import Profile
from gpulab.hub.refusals import MAX_BODY_BYTES, refusal, shown
from gpulab.hub.warmpoolservice import GPUWarmPool
from gpulab.hub.workspaces import Workspaces, keeps_workspaces
from gpulab.spawner.environment import AssignedGPU, Enforcement, enforcement_for
from gpulab.spawner.gpu_summary import GPU_SUMMARY_OPTION, gpu_summary, without_gpu_summary
from gpulab.spawner.names import (
    DECLARED_INVENTORY,
    GPU_INVENTORY_ENV,
    INVENTORY_LABEL,
    SIMULATED_INVENTORY,
)
from gpulab.spawner.picker import PickerRow, render_picker
from gpulab.spawner.workspaces.base import WORKSPACE_OPTION_KEYS, workspace_choices

_ALLOWED_OPTION_KEYS = {"profile", *WORKSPACE_OPTION_KEYS}


def _status_for(error: AllocationError) -> int:
    if isinstance(error, QuotaExceeded):
        return 403
    if isinstance(error, NoCapacity | AlreadyAllocated):
        return 409
    return 400


def node_inventory(inventory: Any, node_name: str) -> str:
    """How `inventory`'s node `node_name` knows its GPUs: 'declared' or 'simulated' (nothing to
    measure), '' for GPUs the driver reports or an unknown node (pure)."""
    for node in inventory.nodes:
        if node.name == node_name:
            return str(node.labels.get(INVENTORY_LABEL, ""))
    return ""


def inventory_environment(kind: str) -> dict[str, str]:
    """GPU_INVENTORY_ENV for a node of inventory `kind` whose GPUs nothing can measure, so a
    server's or Dask worker's monitor simulates the GPUs the hub placed it on (pure)."""
    return {GPU_INVENTORY_ENV: kind} if kind in (DECLARED_INVENTORY, SIMULATED_INVENTORY) else {}


class GPUSpawnerMixin(Configurable):
    """Profiles, quotas and GPU allocation for a JupyterHub spawner (see `GPUCapacity` for the
    catalog, inventory and quota settings)."""

    queue_timeout_seconds = Integer(
        0,
        config=True,
        help="""How long a spawn waits for GPUs to free up when its profile has none free
        (0: refuse at once with a message saying so). Waiting spawns are counted in the picker
        ('none free, 2 waiting'). Keep it below `Spawner.start_timeout`.""",
    )

    allocation_id_template = Unicode(
        "{username}/{servername}",
        config=True,
        help="How a server's allocation is named in the allocator (and its database).",
    )

    # -- shared state --------------------------------------------------------------------------

    @property
    def gpu_capacity(self) -> GPUCapacity:
        return GPUCapacity.instance(config=self.config, log=self.log)

    @property
    def allocation_id(self) -> str:
        return self.allocation_id_template.format(username=self.user.name, servername=self.name)

    @property
    def user_groups(self) -> frozenset[str]:
        return frozenset(g.name for g in getattr(self.user, "groups", []) or [])

    @property
    def is_admin(self) -> bool:
        return bool(getattr(self.user, "admin", False))

    gpulab_placement: Placement | None = None
    gpulab_enforcement: Enforcement | None = None

    # -- profile picker ------------------------------------------------------------------------

    def isolation_preview(self, profile: Profile) -> str:
        """What the isolation of a profile will be, before a GPU is picked."""
        gpus = []
        if profile.gpu > 0:
            models = profile.gpu_models or self.gpu_capacity.inventory.models
            sample = next(
                (
                    g
                    for node in self.gpu_capacity.inventory.nodes
                    for g in node.gpus
                    if g.model in models
                ),
                None,
            )
            if sample is not None:
                milli = profile.gpu_milli or 1000
                count = max(1, profile.num_gpu)
                gpus = [AssignedGPU(sample.uuid, sample.model, sample.memory_mib, milli)] * count
        return self.describe_enforcement(gpus).isolation

    def describe_enforcement(self, gpus: list[AssignedGPU]) -> Enforcement:
        """How a placement is enforced by this spawner; backends override (MPS, MIG, HAMi...)."""
        return enforcement_for(gpus, mps_available=False)

    async def gpulab_options_form(self, spawner: Any = None) -> str:
        capacity = self.gpu_capacity
        await capacity.ready()
        profiles = capacity.visible_profiles(self.user_groups, self.is_admin)
        if not profiles:
            return "<p>No profile is available to you; ask an admin to add you to a group.</p>"
        previous = (self.user_options or {}).get("profile")
        default = previous if capacity.profile(str(previous)) else None
        default = default or next((p.slug for p in profiles if p.default), profiles[0].slug)
        hour_budget = capacity.hour_budget(self.user.name, self.user_groups)
        pool = GPUWarmPool.instance(config=self.config, log=self.log)
        rows = []
        for p in profiles:
            a = capacity.availability(p)
            # a full profile stays selectable when spawns may wait in the queue for it
            reason = self._closed_because(p, a, hour_budget)
            rows.append(
                PickerRow(
                    a,
                    self.isolation_preview(p),
                    p.slug == default,
                    bool(reason),
                    reason,
                    ready_now=pool.ready_count(p.slug),
                )
            )
        workspace = await self.workspace_offer() if isinstance(self, Workspaces) else None
        return render_picker(
            rows,
            inventory_label=capacity.inventory_label,
            declared=capacity.inventory_is_declared,
            quota=capacity.quota_summary(self.user.name, self.user_groups),
            notices=capacity.take_notices(self.user.name),
            workspace=workspace,
            workspaces_url=f"{self.hub.base_url}gpulab/workspaces" if self.hub else "",
            hour_budget=hour_budget,
        )

    def _closed_because(
        self, profile: Profile, availability: Any, hour_budget: HourBudgetStanding | None = None
    ) -> str:
        """Why the picker disables a profile ('' when it may be chosen): the same checks a start
        makes, so that a person is not offered what would be refused."""
        if not availability.fits_inventory:
            return "Larger than any machine here"
        if profile.gpu > 0 and hour_budget is not None and hour_budget.exhausted:
            return "Your GPU-hour budget is used up"
        over = self.gpu_capacity.over_quota(profile, self.user.name, self.user_groups)
        if over:
            return over
        # a full profile stays selectable when spawns may wait in the queue for it
        if availability.free == 0 and not self.queue_timeout_seconds:
            return "None free right now"
        return ""

    @default("options_from_form")
    def _default_options_from_form(self) -> Any:
        return self.gpulab_options_from_form

    def gpulab_options_from_form(self, formdata: dict[str, list[str]]) -> dict[str, Any]:
        """The picker's form -> user_options (a method of its own, so that configuring
        `Spawner.options_from_form` still takes effect)."""
        values = formdata.get("profile") or [""]
        options: dict[str, Any] = {"profile": values[0]}
        snapshot = (formdata.get("restore_snapshot") or [""])[0]
        if snapshot:
            options["restore_snapshot"] = snapshot
        if formdata.get("restore_kernels"):
            options["restore_kernels"] = True
        return options

    # -- validation ----------------------------------------------------------------------------

    gpulab_profile: Profile | None = None

    @default("apply_user_options")
    def _default_apply_user_options(self) -> Any:
        # dispatch on the instance so that backends can override the method
        return lambda spawner, user_options: spawner.gpulab_apply_user_options(user_options)

    def gpulab_apply_user_options(self, user_options: Any) -> None:
        """JupyterHub's apply_user_options hook: validate the choice before anything starts."""
        # a GPU summary among the options is the hub's own, copied back (gpulab.spawner.
        # gpu_summary): no choice of the user's, and never kept as the next start's default
        user_options = without_gpu_summary(user_options)
        self.user_options = without_gpu_summary(self.user_options)
        orm_spawner = getattr(self, "orm_spawner", None)
        if orm_spawner is not None:
            orm_spawner.user_options = without_gpu_summary(orm_spawner.user_options)
        self.gpulab_profile = self.resolve_profile(user_options)
        snapshot, kernels = workspace_choices(user_options)
        if (snapshot or kernels) and not keeps_workspaces(self):
            raise refusal(400, f"{type(self).__name__} keeps no workspace checkpoints")

    def resolve_profile(self, user_options: Any) -> Profile:
        """The profile a request names, refused with a readable 4xx when it is unknown,
        malformed or closed to the user's groups. Same checks for the form and the REST API."""
        capacity = self.gpu_capacity
        if user_options is None:
            user_options = {}
        user_options = without_gpu_summary(user_options)
        if not isinstance(user_options, dict):
            raise refusal(
                400,
                "Server options must be a JSON object like {'profile': 'gpu-1'}, got "
                + shown(user_options),
            )
        size = len(json.dumps(user_options, default=str))
        if size > MAX_BODY_BYTES:
            raise refusal(
                413, f"Server options are {size} bytes; gpulab accepts at most {MAX_BODY_BYTES}"
            )
        unknown = set(user_options) - _ALLOWED_OPTION_KEYS
        if unknown:
            raise refusal(
                400,
                f"Unknown server option(s) {shown(sorted(unknown))}; gpulab takes 'profile' "
                f"(one of {[p.slug for p in capacity.catalog]}), 'restore_snapshot' (a snapshot "
                "id) and 'restore_kernels' (true/false)",
            )
        slug = user_options.get("profile")
        if slug in (None, ""):
            chosen = capacity.default_profile(self.user_groups, self.is_admin)
            if chosen is None:
                raise refusal(403, f"No profile is available to user {self.user.name!r}")
            return chosen
        if not isinstance(slug, str):
            raise refusal(400, f"'profile' must be a profile name (a string), got {shown(slug)}")
        profile = capacity.profile(slug)
        visible = capacity.visible_profiles(self.user_groups, self.is_admin)
        if profile is None:
            raise refusal(
                400, f"Unknown profile {shown(slug)}; available to you: {[p.slug for p in visible]}"
            )
        if profile not in visible:
            groups = ", ".join(sorted(profile.groups))
            raise refusal(
                403,
                f"Profile {slug!r} is restricted to group(s) {groups}; "
                f"user {self.user.name!r} is not a member",
            )
        return profile

    # -- allocation ----------------------------------------------------------------------------

    def _live_allocation_ids(self) -> set[str]:
        """Allocation ids of every server JupyterHub's database says is running or starting."""
        from jupyterhub import orm
        from sqlalchemy import inspect

        db = inspect(self.orm_spawner).session if self.orm_spawner is not None else None
        if db is None:
            return {self.allocation_id}
        ids = set()
        for orm_spawner in db.query(orm.Spawner).filter(orm.Spawner.server != None):  # noqa: E711
            ids.add(
                self.allocation_id_template.format(
                    username=orm_spawner.user.name, servername=orm_spawner.name
                )
            )
        ids.add(self.allocation_id)
        return ids

    #: related requests (a user's servers, later their jobs and Dask workers) share a rack when
    #: they can; backends with a notion of racks set it
    gpulab_affinity_group: str | None = None

    def gpulab_request(self, profile: Profile) -> Request:
        return self.gpu_capacity.request_for(
            profile,
            allocation_id=self.allocation_id,
            owner=self.user.name,
            groups=self.user_groups,
            affinity_group=self.gpulab_affinity_group,
        )

    async def release_stale_allocation(self) -> None:
        """A server that is starting holds nothing: an allocation under its id is a leftover
        (e.g. of a spawn the hub did not see fail) and is released before it is given anew."""
        capacity = self.gpu_capacity
        if capacity.allocator.get(self.allocation_id) is not None:
            self.log.warning(
                "Releasing stale GPU allocation %s before spawning", self.allocation_id
            )
            await capacity.release(self.allocation_id)

    @classmethod
    def chooses_gpulab_profiles(cls, config: Any) -> bool:
        """gpulab's profiles (`GPUCapacity.profiles`) are what its starts take (the hub's
        `ChoosesGPULabProfiles`: a start without options gets the default one)."""
        return True

    _NO_FALLBACK: Any = object()

    @classmethod
    def class_setting(cls, config: Any, name: str, fallback: Any = _NO_FALLBACK) -> Any:
        """Setting `name` as traitlets resolves it for this class (a subclass's config section
        over its parents'), without an instance: warm pool backends are made before any
        spawner exists. Unset: `fallback`, else the trait's default."""
        value = getattr(cls, name).default() if fallback is cls._NO_FALLBACK else fallback
        for klass in reversed(cls.__mro__):
            section = config.get(klass.__name__)
            if section is not None and name in section:
                value = section[name]
        return value

    async def claim_warm_member(self, profile: Profile) -> Any:
        """A ready warm pool member of `profile` whose reservation is now this server's
        allocation (her quota and budget checked, `gpulab_placement` set), or None: start cold
        (a refusal then gets its usual words from `gpulab_allocate`; a member that could not be
        handed over is discarded). Both backends claim through it; what a member then becomes
        is the backend's."""
        pool = GPUWarmPool.instance(config=self.config, log=self.log)
        if not pool.specs:
            return None
        member = pool.claim(profile.slug)
        if member is None:
            return None
        await self.release_stale_allocation()
        try:
            placement = await self.gpu_capacity.hand_over(member.id, self.gpulab_request(profile))
        except AllocationError as e:
            self.log.info("Warm member %s not used for %s: %s", member.id, self.allocation_id, e)
            await pool.discard(member)
            return None
        # the share is hers from here on: a failure after this leaves it hers (the start goes
        # on, or fails and releases it as any start does), never handed out twice
        self.gpulab_placement = placement
        self.show_gpu_summary(profile.slug, placement)
        return member

    async def gpulab_allocate(self, profile: Profile) -> Placement:
        """Place this server's request; waits up to queue_timeout_seconds when nothing fits."""
        capacity = self.gpu_capacity
        await capacity.ready()
        if capacity.inventory_source != "kubernetes":  # the cluster's pods are the record there
            capacity.reconcile(self._live_allocation_ids())
        if not capacity.fits_inventory(profile):
            raise refusal(
                409,
                f"Profile {profile.display_name!r} asks for more than any machine here has "
                f"({capacity.inventory_label}); pick a smaller profile",
            )
        request = self.gpulab_request(profile)
        await self.release_stale_allocation()
        deadline = time.monotonic() + self.queue_timeout_seconds
        while True:
            try:
                placement = await capacity.place(request)
                break
            except NoCapacity as e:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise refusal(
                        409, f"Profile {profile.display_name!r} cannot start now: {e.reason}"
                    ) from None
                self._gpulab_progress = f"Waiting for {profile.gpu_label}: {e.reason}"
                with capacity.waiting(profile.slug):
                    await capacity.wait_for_release(timeout=min(remaining, 5.0))
            except QuotaExceeded as e:
                advice = capacity.quota_refusal(
                    e.reason, self.user.name, self.user_groups, self.is_admin
                )
                raise refusal(403, f"GPU quota exceeded: {advice}") from None
            except (InvalidRequest, AlreadyAllocated) as e:
                raise refusal(_status_for(e), e.reason) from None
        self.gpulab_placement = placement
        self.show_gpu_summary(profile.slug, placement)
        self.log.info(
            "GPU allocation %s (profile %s) -> %s %s",
            request.id,
            profile.slug,
            placement.node,
            [(s.uuid, s.milli) for s in placement.gpus],
        )
        return placement

    async def gpulab_release(self) -> None:
        released = await self.gpu_capacity.release(self.allocation_id)
        self.gpulab_placement = None
        self.user_options = without_gpu_summary(self.user_options)
        if released is not None:
            self.log.info("Released GPU allocation %s", self.allocation_id)

    def assigned_gpus(self, placement: Placement) -> list[AssignedGPU]:
        capacity = self.gpu_capacity
        out = []
        for share in placement.gpus:
            gpu = capacity.gpu_by_uuid(share.uuid)
            out.append(
                AssignedGPU(share.uuid, gpu.model, gpu.memory_mib, share.milli, gpu.mig_profile)
            )
        return out

    def node_inventory(self, node_name: str) -> str:
        """How the node's GPUs are known: 'declared' or 'simulated' (nothing to measure: the
        server's monitor simulates them), '' for GPUs the driver reports or an unknown node."""
        return node_inventory(self.gpu_capacity.inventory, node_name)

    def inventory_environment(self, placement: Placement) -> dict[str, str]:
        """GPU_INVENTORY_ENV when the placement's node is declared (no device to measure), so
        the server's monitor simulates the GPUs the hub placed it on."""
        return inventory_environment(self.node_inventory(placement.node))

    def restore_placement(self) -> None:
        """After a hub restart, pick our placement back up from the allocator's store."""
        self.gpulab_placement = self.gpu_capacity.allocator.get(self.allocation_id)
        if self.gpulab_placement is not None:
            self.show_gpu_summary(None, self.gpulab_placement)

    def show_gpu_summary(self, profile: str | None, placement: Placement) -> None:
        """Put the placement's summary where JupyterHub's admin page shows it (the in-memory
        user_options only: see gpulab.spawner.gpu_summary)."""
        summary = gpu_summary(profile, placement, self.gpu_capacity.gpu_by_uuid)
        options = without_gpu_summary(self.user_options) or {}
        self.user_options = {**options, GPU_SUMMARY_OPTION: summary}

    async def gpulab_progress(self) -> AsyncIterator[dict[str, Any]]:
        last = None
        while self._spawn_pending:
            message = getattr(self, "_gpulab_progress", None)
            if message and message != last:
                last = message
                yield {"progress": 10, "message": message}
            await asyncio.sleep(1)
