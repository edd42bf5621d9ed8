"""GPUCapacity: the hub's one view of GPUs - inventory, profile catalog, quotas and allocations.

A traitlets SingletonConfigurable so that every spawner, the hub's REST handlers and the admin
panel share one allocator per hub process. The allocator itself is pure and synchronous; calls go
through a worker thread so that its SQLite commit never blocks the hub's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import yaml
from traitlets import Any as AnyTrait
from traitlets import Bool, Dict, Float, List, Unicode, default, validate
from traitlets.config import SingletonConfigurable

from gpulab.hub import inventory as inv
from gpulab.hub.allocator import (
    DEFAULT_POLICY,
    Allocator,
    Inventory,
    NoCapacity,
    Node,
    Placement,
    Quota,
    QuotaExceeded,
    Request,
)
from gpulab.hub.allocator.allocator import Listener
from gpulab.hub.profiles import (
    MILLI_PER_GPU,
    Profile,
    ProfileError,
    format_gpu_amount,
    parse_catalog,
    parse_gpus,
    parse_memory_mib,
)


@dataclass(frozen=True)
class ProfileAvailability:
    profile: Profile
    free: int
    waiting: int
    #: False when the profile cannot fit even on an idle machine (e.g. 8 GPUs on a 2-GPU box)
    fits_inventory: bool = True

    @property
    def label(self) -> str:
        """'1/4 GPU - 11 free', '8 GPUs - none free, 2 waiting'."""
        if not self.fits_inventory:
            return f"{self.profile.gpu_label} - larger than any machine here"
        if self.profile.gpu == 0:
            text = "no GPU"
        else:
            text = f"{self.profile.gpu_label} - " + (
                f"{self.free} free" if self.free else "none free"
            )
        if self.waiting:
            text += f", {self.waiting} waiting"
        return text


def _gpus_to_milli(value: Any, field_name: str) -> int:
    """Quotas may be any exact amount (1.5, '3/2', 8), not only catalog steps."""
    if isinstance(value, bool):
        raise ProfileError(f"{field_name}: expected a number of GPUs, got {value!r}")
    # a float is read as the decimal it prints as: 1.1 is 11/10 (1100 milli), not the binary
    # 1.100000000000000088... that Fraction(1.1) gives and 1000 milli cannot hold
    text = value.strip() if isinstance(value, str) else None
    if isinstance(value, float):
        text = repr(value)
    try:
        amount = Fraction(value) if text is None else Fraction(text)
    except (ValueError, ZeroDivisionError, TypeError, OverflowError):  # nan, inf, 'x', [..]
        raise ProfileError(
            f"{field_name}: {value!r} is not a number of GPUs (e.g. 2, 1.5 or '3/8'; "
            "None for no limit)"
        ) from None
    if amount < 0:
        raise ProfileError(f"{field_name}: {value!r} is negative")
    milli = amount * MILLI_PER_GPU
    if milli.denominator != 1:
        raise ProfileError(f"{field_name}: {value!r} is finer than 1/1000 GPU")
    return int(milli)


#: the generic hint gpulab.hub.allocator.quota appends to a quota refusal; `quota_refusal` puts
#: advice that names this catalog's profiles in its place
ALLOCATOR_QUOTA_HINT = " Release a server or ask for a preemptible (spot) server."

#: how a refusal for lack of GPU-hours begins (`GPULedger.launch_refusal`)
HOUR_BUDGET_REFUSAL = "GPU-hour budget used up"


@dataclass(frozen=True)
class HourBudgetStanding:
    """A user's tightest GPU-hour budget as the picker shows it."""

    #: 'GPU-hours: 12.5 of 100 left (30 days)'
    text: str
    #: the launch check's refusal when the budget is used up ('' while GPU-hours are left)
    refusal: str = ""

    @property
    def exhausted(self) -> bool:
        return bool(self.refusal)


#: (placement, reason) -> returns once nothing of that allocation runs
Evict = Callable[[Placement, str], Awaitable[None]]


def profile_milli(profile: Profile) -> int:
    """Milli-GPU a profile counts against a quota (a fraction of one GPU, or whole GPUs)."""
    return int(profile.gpu * 1000)


def _slugs(profiles: list[Profile]) -> str:
    return ", ".join(repr(p.slug) for p in profiles[:4]) + (", ..." if len(profiles) > 4 else "")


class ProfileUnavailable(ValueError):
    """A profile a user may not choose for a workload, or that never fits (the message says
    which, for her)."""


class GPUCapacity(SingletonConfigurable):
    """GPU inventory, profile catalog, quotas and live allocations of this hub."""

    profiles = List(
        Dict(),
        config=True,
        help="""The profile catalog users pick from. Each entry is a dict with:
        `slug` (required, e.g. 'gpu-quarter'), `display_name`, `description`,
        `gpus` (0, '1/8' .. '7/8' in 1/8 steps, or a whole number), `gpu_model` (one model or
        'A100-SXM4-80GB|H100-80GB-HBM3'), `cpu_limit` (cores), `mem_limit` ('16G'),
        `groups` (only members of these groups see and may use it; admins see all),
        `priority` ('on-demand' or 'preemptible') and `default` (preselected).
        Ignored when `profiles_file` is set.""",
    )

    @default("profiles")
    def _default_profiles(self) -> list[dict[str, Any]]:
        from gpulab.hub.profiles import DEFAULT_CATALOG

        return [dict(p) for p in DEFAULT_CATALOG]

    profiles_file = Unicode(
        "",
        config=True,
        help="""A YAML file with the profile catalog (a list of profile dicts, or a mapping with a
        'profiles' key). When set it replaces `profiles`.""",
    )

    inventory_source = Unicode(
        "auto",
        config=True,
        help="""Where the GPU inventory comes from: 'nvml' (discover GPUs through the NVIDIA
        driver), 'declared' (use `declared_inventory`, for machines without a driver), 'auto'
        (NVML when a driver answers, otherwise the declared inventory), or 'kubernetes' (the
        cluster's Nodes; the default when JupyterHub.spawner_class is a Kubernetes spawner).""",
    )

    @default("inventory_source")
    def _default_inventory_source(self) -> str:
        # a hub that spawns on Kubernetes takes its inventory from the cluster's Nodes
        spawner = self.config.get("JupyterHub", {}).get("spawner_class", "")
        spawner_name = getattr(spawner, "__name__", str(spawner)).lower()
        return "kubernetes" if "kube" in spawner_name else "auto"

    @validate("inventory_source")
    def _check_source(self, proposal: Any) -> str:
        value = proposal["value"]
        if value not in ("auto", "nvml", "declared", "kubernetes"):
            raise ValueError(
                "GPUCapacity.inventory_source must be 'auto', 'nvml', 'declared' or 'kubernetes', "
                f"not {value!r}"
            )
        return str(value)

    declared_inventory = Unicode(
        "",
        config=True,
        help="""GPUs of this machine as declared by the admin, e.g. '8 x A100-SXM4-80GB' or
        '4 x A100-SXM4-80GB, 2 x T4'. Used where no NVIDIA driver is present; the UI and logs label
        such an inventory 'declared', since nothing was measured. Empty: CPU-only.""",
    )

    node_cpu_limit = Float(
        0.0,
        config=True,
        help="CPU cores the allocator may hand out on this machine (0: all cores the OS reports).",
    )
    node_mem_limit = Unicode(
        "",
        config=True,
        help="Memory the allocator may hand out on this machine, e.g. '512G' (empty: all of it).",
    )

    db_url = Unicode(
        "sqlite:///gpulab-allocations.sqlite",
        config=True,
        help="""Where allocations are persisted, in JupyterHub's URL style ('sqlite:///path',
        relative to the hub's working directory). Allocations outlive hub restarts: with
        `JupyterHub.cleanup_servers = False` running servers keep their GPUs.""",
    )

    placement_policy = Unicode(
        DEFAULT_POLICY,
        config=True,
        help="""Placement policy of the allocator: 'gpulab' (fragmentation-aware, the default),
        'fgd', 'best-fit', 'first-fit' or 'random' (see gpulab.hub.allocator).""",
    )

    headroom_fraction = Float(
        0.0,
        config=True,
        help="""Share of GPU capacity (0 to <1) kept free for on-demand profiles: preemptible
        profiles cannot use it, so an on-demand user still finds a GPU when the machine is busy.""",
    )

    @validate("headroom_fraction")
    def _check_headroom(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0 <= value < 1:
            raise ValueError(f"GPUCapacity.headroom_fraction must be in [0, 1), not {value!r}")
        return value

    user_quota_gpus = Dict(
        config=True,
        help="""Per-user GPU budgets, in GPUs (fractions exact: '3/2', 0.5): {'alice': 2}.
        Counted over all of a user's running servers.""",
    )
    group_quota_gpus = Dict(
        config=True,
        help="""Per-group GPU budgets, in GPUs, summed over all members: {'students': 4}.""",
    )
    default_user_quota_gpus = AnyTrait(
        None,
        config=True,
        allow_none=True,
        help="GPU budget of users not named in `user_quota_gpus` (None: unlimited).",
    )
    allow_preemptible_over_quota = Bool(
        True,
        config=True,
        help="""Let preemptible profiles run beyond a user's quota; such servers are the first
        to be reclaimed when on-demand work needs the GPUs.""",
    )

    # -- derived state -------------------------------------------------------------------------

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._waiting: Counter[str] = Counter()
        self._release_event: asyncio.Event | None = None
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._fits_idle: dict[str, bool] = {}
        self._notices: dict[str, list[str]] = {}
        self._other_owners: list[Callable[[], set[str]]] = []
        self._evictors: list[tuple[Callable[[str], bool], Evict]] = []
        self._allocator_listeners: list[Listener] = []
        self._end_reasons: dict[str, str] = {}
        #: why a request may not start for lack of GPU-hours, or None (`GPULedger` sets it)
        self.hour_budget_check: Callable[[Request], str | None] | None = None
        #: the tightest GPU-hour budget binding a user and her groups, or None when none binds
        #: her (`GPULedger` sets it; the picker shows it)
        self.hour_budget_standing: (
            Callable[[str, frozenset[str]], HourBudgetStanding | None] | None
        ) = None
        self.quota = self._quota()
        #: whether `allocator` holds the real allocations: on Kubernetes only once the cluster's
        #: watches have synced and `attach` gave the rebuilt allocator (before, an empty one)
        self.synced = self.inventory_source != "kubernetes"
        if self.inventory_source == "kubernetes":
            # the cluster's Nodes and pods are the inventory and the allocations; the Kubernetes
            # spawner attaches them once its watches have synced
            self.inventory = Inventory([])
            self.inventory_label = "Kubernetes cluster (not synced yet)"
            self.catalog = self._load_catalog(check_models=False)
            self.allocator = Allocator(self.inventory, policy=self.placement_policy)
        else:
            node, self.inventory_label = self._discover()
            self.inventory = Inventory([node])
            self.catalog = self._load_catalog()
            self.allocator = Allocator.open(
                self.inventory,
                db_url=self.db_url,
                policy=self.placement_policy,
                headroom_fraction=self.headroom_fraction,
                quota=self.quota,
            )
        self.log.info(
            "gpulab GPU inventory: %s; %d profiles; %d allocations restored",
            self.inventory_label,
            len(self.catalog),
            len(self.allocator.allocations()),
        )
        self._reconciled = False

    def _discover(self) -> tuple[Any, str]:
        cpu_milli = int(self.node_cpu_limit * 1000) if self.node_cpu_limit else None
        memory_mib = (
            parse_memory_mib(self.node_mem_limit, field_name="GPUCapacity.node_mem_limit")
            if self.node_mem_limit
            else None
        )
        source = self.inventory_source
        if source in ("auto", "nvml"):
            ok, why = inv.nvml_available()
            if ok:
                node = inv.discover_nvml(cpu_milli=cpu_milli, memory_mib=memory_mib)
                return node, f"NVML: {self._describe(node)}"
            if source == "nvml":
                raise inv.InventoryError(f"GPUCapacity.inventory_source is 'nvml' but {why}")
            self.log.info("No NVML (%s); using the declared inventory", why)
        if not self.declared_inventory:
            node = Node(
                name=socket.gethostname(),
                cpu_milli=cpu_milli or inv.machine_cpu_milli(),
                memory_mib=memory_mib or inv.machine_memory_mib(),
            )
            self.log.warning(
                "No GPUs: no NVIDIA driver and GPUCapacity.declared_inventory is empty"
            )
            return node, "no GPUs (no NVIDIA driver, nothing declared)"
        node = inv.parse_declared(
            self.declared_inventory, cpu_milli=cpu_milli, memory_mib=memory_mib
        )
        label = f"declared: {self._describe(node)} (simulated - no NVIDIA driver on this machine)"
        self.log.warning("gpulab is using a DECLARED GPU inventory: %s", label)
        return node, label

    @staticmethod
    def _describe(node: Any) -> str:
        models = Counter(g.model for g in node.gpus)
        return ", ".join(f"{n} x {m}" for m, n in models.items()) or "no GPUs"

    @property
    def inventory_is_declared(self) -> bool:
        return self.inventory_label.startswith("declared")

    #: inventory sources kept current by a spawner backend, by `inventory_source` name: the
    #: backend registers itself when its module is imported (gpulab.spawner.kube.spawner:
    #: "kubernetes"), so the hub never imports a spawner package (no hub -> spawner cycle), and
    #: a hub without the Kubernetes extra never loads a Kubernetes client. JupyterHub imports its
    #: spawner_class while loading the config, before any request can reach `ready()`.
    _inventory_sources: ClassVar[dict[str, Callable[[GPUCapacity], Awaitable[object]]]] = {}

    @classmethod
    def register_inventory_source(
        cls, name: str, ensure: Callable[[GPUCapacity], Awaitable[object]]
    ) -> None:
        """`await ensure(capacity)` makes the allocator reflect source `name` (e.g. syncs the
        cluster's watches and calls `attach`); `ready()` calls it for that inventory_source."""
        cls._inventory_sources[name] = ensure

    async def ready(self) -> None:
        """Make sure the allocator reflects the current cluster (Kubernetes: watches synced)."""
        ensure = self._inventory_sources.get(self.inventory_source)
        if ensure is not None:
            await ensure(self)
        elif self.inventory_source == "kubernetes":
            raise RuntimeError(
                "GPUCapacity.inventory_source is 'kubernetes' but no Kubernetes spawner is loaded: "
                "set JupyterHub.spawner_class = 'gpulab-kube' (needs the gpulab[kube] extra)"
            )

    def attach(self, allocator: Allocator, inventory: Inventory, label: str) -> None:
        """Use an allocator maintained elsewhere (the Kubernetes backend's, rebuilt from the
        cluster's Nodes and pods)."""
        old = self.allocator
        self.allocator, self.inventory, self.inventory_label = allocator, inventory, label
        self.synced = True
        self._fits_idle.clear()
        for listener in self._allocator_listeners:
            old.remove_listener(listener)
            allocator.add_listener(listener)
        if self._allocator_listeners:
            # what changed between the two allocators (pods gone, nodes lost) reaches the
            # listeners as one snapshot
            allocator.notify_listeners()

    def add_allocator_listener(self, listener: Listener) -> None:
        """Follow every change of this hub's allocations, also across `attach` (see
        `Allocator.add_listener`; the GPU-hour ledger's feed)."""
        self._allocator_listeners.append(listener)
        self.allocator.add_listener(listener)

    def _load_catalog(self, check_models: bool = True) -> list[Profile]:
        entries: Any = self.profiles
        if self.profiles_file:
            data = yaml.safe_load(Path(self.profiles_file).read_text())
            entries = data.get("profiles") if isinstance(data, dict) else data
            if not isinstance(entries, list):
                raise ProfileError(
                    f"GPUCapacity.profiles_file {self.profiles_file}: expected a list of profiles"
                )
        return parse_catalog(entries, known_models=self.inventory.models if check_models else None)

    def _quota(self) -> Quota:
        users = {
            u: _gpus_to_milli(v, f"GPUCapacity.user_quota_gpus[{u!r}]")
            for u, v in self.user_quota_gpus.items()
        }
        groups = {
            g: _gpus_to_milli(v, f"GPUCapacity.group_quota_gpus[{g!r}]")
            for g, v in self.group_quota_gpus.items()
        }
        default_milli = (
            None
            if self.default_user_quota_gpus is None
            else _gpus_to_milli(self.default_user_quota_gpus, "GPUCapacity.default_user_quota_gpus")
        )
        return Quota(
            users=users,
            groups=groups,
            default_user_milli=default_milli,
            allow_preemptible_over_quota=self.allow_preemptible_over_quota,
        )

    # -- catalog queries -----------------------------------------------------------------------

    def profile(self, slug: str) -> Profile | None:
        return next((p for p in self.catalog if p.slug == slug), None)

    def visible_profiles(self, groups: frozenset[str], is_admin: bool) -> list[Profile]:
        return [p for p in self.catalog if p.visible_to(groups, is_admin)]

    def default_profile(self, groups: frozenset[str], is_admin: bool) -> Profile | None:
        """The profile a start that names none gets: the catalog's `default` one when the user
        may use it, else her first visible one; None when she may use none."""
        visible = self.visible_profiles(groups, is_admin)
        default = next((p for p in self.catalog if p.default), None)
        return default if default in visible else (visible[0] if visible else None)

    def workload_profile(self, slug: str, groups: frozenset[str], is_admin: bool) -> Profile:
        """The profile `slug` for a workload (a job run, a Dask cluster's workers) of a user in
        `groups`; ProfileUnavailable, with the sentence for her, when it is not one of hers or
        is larger than any machine here (it would wait forever)."""
        profile = self.profile(slug)
        visible = self.visible_profiles(groups, is_admin)
        if profile is None or profile not in visible:
            names = ", ".join(p.slug for p in visible) or "none"
            raise ProfileUnavailable(f"no profile {slug!r} for you; choose one of: {names}")
        if not self.fits_inventory(profile):
            raise ProfileUnavailable(
                f"{profile.slug} is larger than any machine here: it never fits"
            )
        return profile

    def request_for(
        self,
        profile: Profile,
        *,
        allocation_id: str,
        owner: str,
        groups: frozenset[str],
        affinity_group: str | None = None,
        workload: str = "server",
    ) -> Request:
        """The allocator's request for one `workload` ("server", "job", "dask") of `profile`."""
        return Request(
            id=allocation_id,
            owner=owner,
            groups=groups,
            cpu_milli=int(profile.cpu_limit * 1000) if profile.cpu_limit else 0,
            memory_mib=profile.mem_limit_mib or 0,
            num_gpu=profile.num_gpu,
            gpu_milli=profile.gpu_milli,
            gpu_models=profile.gpu_models,
            priority=profile.priority,  # type: ignore[arg-type]
            nvlink=False,
            affinity_group=affinity_group,
            profile=profile.slug,
            workload=workload,
        )

    def _probe(self, profile: Profile) -> Request:
        return self.request_for(
            profile, allocation_id="capacity-probe", owner="", groups=frozenset()
        )

    def fits_inventory(self, profile: Profile) -> bool:
        """Whether the profile fits on this inventory when nothing else runs."""
        if profile.slug not in self._fits_idle:
            idle = Allocator(self.inventory, policy=self.placement_policy)
            self._fits_idle[profile.slug] = idle.capacity(self._probe(profile)) > 0
        return self._fits_idle[profile.slug]

    def availability(self, profile: Profile) -> ProfileAvailability:
        return ProfileAvailability(
            profile,
            self.allocator.capacity(self._probe(profile)),
            self._waiting[profile.slug],
            self.fits_inventory(profile),
        )

    def quota_summary(self, owner: str, groups: frozenset[str]) -> str | None:
        """'GPU quota: 0.25 GPU in use, 1.25 GPUs left' (None when unlimited)."""
        left = self.allocator.quota_left_milli(owner, groups)
        if left is None:
            return None
        used = self.allocator.usage_milli(owner)
        return f"GPU quota: {format_gpu_amount(used)} in use, {format_gpu_amount(left)} left"

    def hour_budget(self, owner: str, groups: frozenset[str]) -> HourBudgetStanding | None:
        """The user's tightest GPU-hour budget (None: none binds her, or no ledger runs)."""
        if self.hour_budget_standing is None:
            return None
        return self.hour_budget_standing(owner, groups)

    def over_quota(self, profile: Profile, owner: str, groups: frozenset[str]) -> str | None:
        """Why `profile` cannot start within the user's remaining GPU budget (None: it can)."""
        left = self.allocator.quota_left_milli(owner, groups)
        if left is None or profile_milli(profile) <= left:
            return None
        if profile.priority == "preemptible" and self.allow_preemptible_over_quota:
            return None
        return (
            f"Needs {format_gpu_amount(profile_milli(profile))}; your GPU quota has "
            f"{format_gpu_amount(left)} left"
        )

    def quota_advice(self, owner: str, groups: frozenset[str], is_admin: bool) -> str:
        """What a user over quota can do, naming profiles of this catalog that they may use."""
        left = self.allocator.quota_left_milli(owner, groups) or 0
        visible = self.visible_profiles(groups, is_admin)
        fitting = sorted(
            (p for p in visible if 0 < profile_milli(p) <= left),
            key=profile_milli,
            reverse=True,
        )
        spot = [p for p in visible if p.priority == "preemptible" and p not in fitting]
        cpu = [p for p in visible if profile_milli(p) == 0]
        options = []
        if fitting:
            options.append(
                f"pick a profile within the {format_gpu_amount(left)} left ({_slugs(fitting)})"
            )
        if spot and self.allow_preemptible_over_quota:
            options.append(f"a preemptible profile, which may run over quota ({_slugs(spot)})")
        if not fitting and cpu:
            options.append(f"a CPU-only server ({_slugs(cpu)})")
        if not options:
            return "Stop one of your GPU servers first."
        return "Stop one of your GPU servers, or " + ", or ".join(options) + "."

    def quota_refusal(self, reason: str, owner: str, groups: frozenset[str], is_admin: bool) -> str:
        """The allocator's quota refusal with advice from this catalog in place of its generic
        hint (which names a preemptible server even where the catalog has none)."""
        problem = reason.removesuffix(ALLOCATOR_QUOTA_HINT).rstrip()
        if problem.startswith(HOUR_BUDGET_REFUSAL):  # time, not GPUs held, is what ran out
            cpu = [p for p in self.visible_profiles(groups, is_admin) if profile_milli(p) == 0]
            hint = f" A CPU-only server ({_slugs(cpu)}) needs none." if cpu else ""
            return f"{problem} It frees up as older GPU-hours leave the window.{hint}"
        return f"{problem} {self.quota_advice(owner, groups, is_admin)}"

    # -- allocation ----------------------------------------------------------------------------

    async def place(self, request: Request) -> Placement:
        """Place `request`; when an on-demand request does not fit, preemptible work of an owner
        that can give it back (`add_evictor`: job runs) is evicted to make room, and this returns
        once nothing of it runs (a share is never handed out while its last holder still uses
        it). Preemptible servers are evicted by their spawner (GPUKubeSpawner), not here."""
        if self.hour_budget_check is not None:
            budget_refusal = self.hour_budget_check(request)
            if budget_refusal is not None:
                raise QuotaExceeded(budget_refusal)
        refusal: NoCapacity | None = None
        try:
            return await asyncio.to_thread(self.allocator.place, request)
        except NoCapacity as e:
            if request.preemptible or not self._evictors:
                raise
            refusal = e
        try:
            placement, victims = await asyncio.to_thread(
                self.allocator.preempt_and_place, request, self._has_evictor
            )
        except NoCapacity:
            raise refusal from None  # its reason, not the preemption search's
        for victim in victims:
            await self.evict(victim, f"preempted for on-demand work {request.id}")
        return placement

    async def hand_over(self, held_id: str, request: Request) -> Placement:
        """Give `held_id`'s GPUs (a warm pool member's reservation) to `request`, checked as
        `place` checks a start (GPU-hour budget, quota); AllocationError otherwise, and the
        reservation is left as it was."""
        if self.hour_budget_check is not None:
            budget_refusal = self.hour_budget_check(request)
            if budget_refusal is not None:
                raise QuotaExceeded(budget_refusal)
        return await asyncio.to_thread(self.allocator.hand_over, held_id, request)

    def add_evictor(self, owns: Callable[[str], bool], evict: Evict) -> None:
        """Another owner of allocations (the job service) that can give a preemptible one back:
        `owns(allocation_id)` says which are its, `evict(placement, reason)` stops it and returns
        when nothing of it runs. The allocator has already released the victim's share."""
        self._evictors.append((owns, evict))

    def remove_evictor(self, evict: Evict) -> None:
        self._evictors = [(owns, e) for owns, e in self._evictors if e != evict]

    def has_evictor(self, placement: Placement) -> bool:
        """Whether another owner (the job or Dask service) can stop `placement`'s work."""
        return self._has_evictor(placement)

    def _has_evictor(self, placement: Placement) -> bool:
        return any(owns(placement.request.id) for owns, _ in self._evictors)

    async def evict(self, victim: Placement, reason: str) -> bool:
        """Evict `victim` through its owner's evictor; False when no evictor owns it."""
        for owns, evict in self._evictors:
            if owns(victim.request.id):
                self.record_event(victim.request.id, "preempted", reason)
                await evict(victim, reason)
                return True
        return False

    def note_end_reason(self, allocation_id: str, reason: str) -> None:
        """Why `allocation_id` is about to end, for when its holder releases it (a stop by the
        culler, a budget or an admin's preemption: the GPU-hour ledger records it)."""
        self._end_reasons[allocation_id] = reason

    async def release(self, allocation_id: str, reason: str | None = None) -> Placement | None:
        noted = self._end_reasons.pop(allocation_id, None)
        why = reason or noted or "released"
        placement = await asyncio.to_thread(self.allocator.release, allocation_id, why)
        if placement is not None and self._release_event is not None:
            event, self._release_event = self._release_event, None
            event.set()
        return placement

    async def wait_for_release(self, timeout: float) -> None:
        """Return when some allocation is released, or after `timeout` seconds."""
        if self._release_event is None:
            self._release_event = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._release_event.wait(), timeout)

    def waiting(self, slug: str) -> _WaitingTicket:
        return _WaitingTicket(self._waiting, slug)

    def keep_allocations(self, live: Callable[[], set[str]]) -> None:
        """Another owner of allocations (the job service): `live()` names those it holds now,
        which `reconcile` must keep although no server has them."""
        self._other_owners.append(live)

    def reconcile(self, live_allocation_ids: set[str]) -> list[Placement]:
        """Release allocations that belong to no server JupyterHub knows of and no other owner
        holds (the hub died between placing and recording a server). Runs once per hub process,
        before the first spawn."""
        if self._reconciled:
            return []
        self._reconciled = True
        live = set(live_allocation_ids)
        for other in self._other_owners:
            live |= other()
        orphans = [p for p in self.allocator.allocations() if p.request.id not in live]
        for p in orphans:
            self.allocator.release(p.request.id)
            self.log.warning("Released orphaned GPU allocation %s on %s", p.request.id, p.node)
        return orphans

    def record_event(self, allocation_id: str, stage: str, message: str) -> None:
        """Watchdog warnings and stops, kept (bounded) for the admin's allocation list."""
        events = self._events.setdefault(allocation_id, [])
        events.append({"time": time.time(), "stage": stage, "message": message})
        del events[:-20]

    def record_notice(self, user: str, message: str) -> None:
        """Something a user should read next time they open the picker (e.g. a preemption)."""
        notices = self._notices.setdefault(user, [])
        notices.append(message)
        del notices[:-5]

    def take_notices(self, user: str) -> list[str]:
        return self._notices.pop(user, [])

    def events_for(self, allocation_id: str) -> list[dict[str, Any]]:
        return list(self._events.get(allocation_id, []))

    def gpu_by_uuid(self, uuid: str) -> Any:
        for node in self.inventory.nodes:
            for gpu in node.gpus:
                if gpu.uuid == uuid:
                    return gpu
        raise KeyError(uuid)


class _WaitingTicket:
    """Counts a spawn as waiting for its profile while the `with` block runs."""

    def __init__(self, counter: Counter[str], slug: str) -> None:
        self._counter, self._slug = counter, slug

    def __enter__(self) -> None:
        self._counter[self._slug] += 1

    def __exit__(self, *exc: object) -> None:
        self._counter[self._slug] -= 1


__all__ = ["GPUCapacity", "ProfileAvailability", "parse_gpus"]
