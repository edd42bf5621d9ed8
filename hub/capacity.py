"""GPUCapacity: the hub's one view of GPUs - inventory, profile catalog, quotas and allocations.

A traitlets SingletonConfigurable so that every spawner, the hub's REST handlers and the admin
panel share one allocator per hub process. The allocator itself is pure and synchronous; calls go
through a worker thread so that its SQLite commit never blocks the hub's event loop.

The class keeps its options, the inventory's discovery and the allocator's making here; its
catalog queries (`capacity_catalog.CapacityCatalog`) and its allocation calls
(`capacity_allocations.CapacityAllocations`) are mixins of their own.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import yaml
from traitlets import Any as AnyTrait
from traitlets import Bool, Dict, Float, List, Unicode, default, validate
from traitlets.config import SingletonConfigurable

from gpulab.hub import inventory as inv
from gpulab.hub.allocator import DEFAULT_POLICY, Allocator, Inventory, Node, Quota, Request
from gpulab.hub.allocator.allocator import Listener
from gpulab.hub.capacity_allocations import CapacityAllocations, Evict
from gpulab.hub.capacity_catalog import CapacityCatalog, HourBudgetStanding
from gpulab.hub.profiles import (
    MILLI_PER_GPU,
    Profile,
    ProfileError,
    parse_catalog,
    parse_gpus,
    parse_memory_mib,
)


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


class GPUCapacity(SingletonConfigurable, CapacityCatalog, CapacityAllocations):
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


__all__ = ["GPUCapacity", "parse_gpus"]
