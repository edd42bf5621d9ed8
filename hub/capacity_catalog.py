"""What a hub's profile catalog answers, as `GPUCapacity` methods: the profiles a user may
pick or run a workload on, the allocator's request for one, how many fit now, and a quota
refusal with advice that names this catalog's profiles; and the values they return.

Apart from `capacity.py` (the options, the inventory and the allocator behind them): these read
the catalog and the allocator, they never change them. A plain mixin, after SingletonConfigurable
in `GPUCapacity`'s bases, so that it adds no options and the config reference is unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from gpulab.hub.allocator import Allocator, Inventory, Request
from gpulab.hub.profiles import Profile, format_gpu_amount


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


def profile_milli(profile: Profile) -> int:
    """Milli-GPU a profile counts against a quota (a fraction of one GPU, or whole GPUs)."""
    return int(profile.gpu * 1000)


def _slugs(profiles: list[Profile]) -> str:
    return ", ".join(repr(p.slug) for p in profiles[:4]) + (", ..." if len(profiles) > 4 else "")


class ProfileUnavailable(ValueError):
    """A profile a user may not choose for a workload, or that never fits (the message says
    which, for her)."""


class CapacityCatalog:
    """The catalog queries of `GPUCapacity` (which sets what is declared here)."""

    catalog: list[Profile]
    allocator: Allocator
    inventory: Inventory
    placement_policy: str
    allow_preemptible_over_quota: bool
    hour_budget_standing: Callable[[str, frozenset[str]], HourBudgetStanding | None] | None
    _fits_idle: dict[str, bool]
    _waiting: Counter[str]

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


__all__ = [
    "ALLOCATOR_QUOTA_HINT",
    "HOUR_BUDGET_REFUSAL",
    "CapacityCatalog",
    "HourBudgetStanding",
    "ProfileAvailability",
    "ProfileUnavailable",
    "profile_milli",
]
