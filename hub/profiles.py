"""The GPU profile catalog: what a user can pick, parsed and validated (pure, no JupyterHub imports).

A profile is a named request shape: how much GPU (none, a fraction of one GPU in 1/8 steps, or a
whole number of GPUs), optionally which GPU models, CPU/memory limits, the priority class and which
groups may see and use it. Admins write the catalog as a list of dicts (traitlets config or YAML).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

MILLI_PER_GPU = 1000
#: the finest fraction the catalog offers; finer shares exist only in traces and jobs
CATALOG_FRACTION_STEP = Fraction(1, 8)
MAX_GPUS_PER_PROFILE = 64

PRIORITIES = ("on-demand", "preemptible")


class ProfileError(ValueError):
    """A catalog entry or a user's profile choice is invalid; the message says which field and why."""


@dataclass(frozen=True)
class Profile:
    slug: str
    display_name: str
    gpu: Fraction = Fraction(0)
    gpu_models: frozenset[str] = frozenset()
    cpu_limit: float | None = None
    mem_limit_mib: int | None = None
    groups: frozenset[str] = frozenset()
    priority: str = "on-demand"
    description: str = ""
    default: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_gpu(self) -> int:
        """Whole GPUs asked for (0 for CPU-only and for fractions)."""
        return int(self.gpu) if self.gpu >= 1 else 0

    @property
    def gpu_milli(self) -> int:
        """Milli-GPU of ONE GPU asked for when the profile is a fraction, else 0."""
        return int(self.gpu * MILLI_PER_GPU) if 0 < self.gpu < 1 else 0

    @property
    def is_fractional(self) -> bool:
        return 0 < self.gpu < 1

    @property
    def gpu_label(self) -> str:
        return format_gpus(self.gpu)

    def visible_to(self, user_groups: Iterable[str], is_admin: bool = False) -> bool:
        """Profiles without `groups` are open to all; admins see every profile."""
        return is_admin or not self.groups or bool(self.groups & set(user_groups))


def format_gpus(gpu: Fraction) -> str:
    """'CPU only', '1/8 GPU', '1 GPU', '8 GPUs'."""
    if gpu == 0:
        return "CPU only"
    if gpu < 1:
        return f"{gpu.numerator}/{gpu.denominator} GPU"
    return f"{int(gpu)} GPU" + ("s" if gpu > 1 else "")


def format_gpu_amount(milli: int) -> str:
    """An exact amount of milli-GPU for people: '0 GPUs', '0.375 GPU', '1.5 GPUs', '2 GPUs'."""
    whole, rest = divmod(milli, MILLI_PER_GPU)
    text = str(whole) if not rest else f"{whole}.{rest:03d}".rstrip("0")
    return f"{text} GPU" + ("" if 0 < milli <= MILLI_PER_GPU else "s")


_FRACTION_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def parse_gpus(value: Any, *, field_name: str = "gpus") -> Fraction:
    """Parse a GPU amount: 0, '1/8', 0.25, 2, '2'. Fractions must be 1/8 steps below one GPU;
    amounts of one GPU or more must be whole. Floats are accepted only when they are exact eighths,
    so 0.1 is refused rather than rounded."""
    if isinstance(value, bool) or value is None:
        raise ProfileError(
            f"{field_name}: expected a number of GPUs like 0, '1/4' or 2, got {value!r}"
        )
    try:
        if isinstance(value, str):
            m = _FRACTION_RE.match(value)
            if m:
                if int(m.group(2)) == 0:
                    raise ProfileError(f"{field_name}: {value!r} divides by zero")
                amount = Fraction(int(m.group(1)), int(m.group(2)))
            else:
                amount = Fraction(value.strip())
        elif isinstance(value, int | float | Fraction):
            amount = Fraction(value)
        else:
            raise ProfileError(
                f"{field_name}: expected a number of GPUs like 0, '1/4' or 2, got {value!r}"
            )
    except (ValueError, ZeroDivisionError, OverflowError) as e:
        if isinstance(e, ProfileError):
            raise
        raise ProfileError(
            f"{field_name}: {value!r} is not a GPU amount (use 0, a fraction like '1/4', or a whole number)"
        ) from None
    if amount < 0:
        raise ProfileError(f"{field_name}: {value!r} is negative; use 0 for a CPU-only profile")
    if amount > MAX_GPUS_PER_PROFILE:
        raise ProfileError(
            f"{field_name}: {value!r} is more than {MAX_GPUS_PER_PROFILE} GPUs for one server"
        )
    if 0 < amount < 1 and (amount / CATALOG_FRACTION_STEP).denominator != 1:
        raise ProfileError(
            f"{field_name}: {value!r} is not a multiple of 1/8 GPU (allowed: 1/8, 1/4, 3/8, 1/2, ... 7/8)"
        )
    if amount >= 1 and amount.denominator != 1:
        raise ProfileError(
            f"{field_name}: {value!r} mixes whole and fractional GPUs; ask for a whole number or a fraction below 1"
        )
    return amount


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|[KMGT])?\s*$", re.IGNORECASE)
_SIZE_FACTOR_MIB = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def parse_memory_mib(value: Any, *, field_name: str = "mem_limit") -> int:
    """'16G', '512M', '16GiB' or a number of bytes -> MiB (the convention of JupyterHub's mem_limit)."""
    if isinstance(value, bool):
        raise ProfileError(f"{field_name}: expected a size like '16G', got {value!r}")
    if isinstance(value, int | float):
        if value <= 0:
            raise ProfileError(f"{field_name}: {value!r} must be positive")
        return max(1, int(value / (1024 * 1024)))
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ProfileError(f"{field_name}: {value!r} is not a size (use e.g. '512M', '16G')")
    number = float(m.group(1))
    unit = (m.group(2) or "")[:1].upper()
    mib = int(number * _SIZE_FACTOR_MIB[unit])
    if mib <= 0:
        raise ProfileError(f"{field_name}: {value!r} must be at least 1 MiB")
    return mib


_SLUG_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_KNOWN_KEYS = {
    "slug",
    "display_name",
    "description",
    "gpus",
    "gpu_model",
    "gpu_models",
    "cpu_limit",
    "mem_limit",
    "groups",
    "priority",
    "default",
    "extra",
}


def parse_profile(
    entry: Mapping[str, Any], *, known_models: Iterable[str] | None = None
) -> Profile:
    """One catalog entry -> Profile. `known_models`, when given, are the inventory's GPU models: a
    profile asking for a model the inventory lacks is a configuration error, not a profile that
    silently never fits."""
    if not isinstance(entry, Mapping):
        raise ProfileError(f"profile entries must be mappings, got {entry!r}")
    unknown = set(entry) - _KNOWN_KEYS
    slug = entry.get("slug")
    where = f"profile {slug!r}" if slug else "profile"
    if unknown:
        raise ProfileError(
            f"{where}: unknown field(s) {sorted(unknown)}; known fields are {sorted(_KNOWN_KEYS)}"
        )
    if not isinstance(slug, str) or not _SLUG_RE.match(slug):
        raise ProfileError(
            f"{where}: 'slug' must be lower-case letters, digits and '-' (got {slug!r})"
        )
    gpu = parse_gpus(entry.get("gpus", 0), field_name=f"{where}: gpus")

    models_value = entry.get("gpu_models", entry.get("gpu_model"))
    if models_value is None:
        models: frozenset[str] = frozenset()
    elif isinstance(models_value, str):
        models = frozenset(m.strip() for m in models_value.split("|") if m.strip())
    else:
        models = frozenset(str(m) for m in models_value)
    if models and gpu == 0:
        raise ProfileError(f"{where}: gpu_model is set but the profile asks for no GPU")
    if models and known_models is not None:
        missing = models - set(known_models)
        if missing:
            raise ProfileError(
                f"{where}: gpu_model {sorted(missing)} is not in the GPU inventory "
                f"(available: {sorted(set(known_models)) or 'none'})"
            )

    cpu_limit = entry.get("cpu_limit")
    if cpu_limit is not None:
        if isinstance(cpu_limit, bool) or not isinstance(cpu_limit, int | float) or cpu_limit <= 0:
            raise ProfileError(
                f"{where}: cpu_limit must be a positive number of cores, got {cpu_limit!r}"
            )
        cpu_limit = float(cpu_limit)
    mem_value = entry.get("mem_limit")
    mem_limit_mib = (
        None if mem_value is None else parse_memory_mib(mem_value, field_name=f"{where}: mem_limit")
    )

    groups_value = entry.get("groups", ())
    if isinstance(groups_value, str):
        groups_value = [groups_value]
    groups = frozenset(str(g) for g in groups_value)

    priority = entry.get("priority", "on-demand")
    if priority not in PRIORITIES:
        raise ProfileError(f"{where}: priority must be one of {list(PRIORITIES)}, got {priority!r}")

    return Profile(
        slug=slug,
        display_name=str(entry.get("display_name") or format_gpus(gpu)),
        gpu=gpu,
        gpu_models=models,
        cpu_limit=cpu_limit,
        mem_limit_mib=mem_limit_mib,
        groups=groups,
        priority=priority,
        description=str(entry.get("description", "")),
        default=bool(entry.get("default", False)),
        extra=dict(entry.get("extra") or {}),
    )


def parse_catalog(
    entries: Iterable[Mapping[str, Any]], *, known_models: Iterable[str] | None = None
) -> list[Profile]:
    """The whole catalog: every entry valid, slugs unique, at most one default."""
    known = None if known_models is None else frozenset(known_models)
    profiles = [parse_profile(e, known_models=known) for e in entries]
    seen: set[str] = set()
    for p in profiles:
        if p.slug in seen:
            raise ProfileError(f"profile {p.slug!r}: slug appears twice in the catalog")
        seen.add(p.slug)
    defaults = [p.slug for p in profiles if p.default]
    if len(defaults) > 1:
        raise ProfileError(f"more than one default profile: {defaults}")
    if not profiles:
        raise ProfileError("the profile catalog is empty; define at least one profile")
    return profiles


#: The catalog an admin gets without configuring one: the shapes named in the product brief.
DEFAULT_CATALOG: list[dict[str, Any]] = [
    {"slug": "cpu", "display_name": "CPU only", "gpus": 0, "default": True},
    {"slug": "gpu-eighth", "display_name": "1/8 GPU", "gpus": "1/8"},
    {"slug": "gpu-quarter", "display_name": "1/4 GPU", "gpus": "1/4"},
    {"slug": "gpu-half", "display_name": "1/2 GPU", "gpus": "1/2"},
    {"slug": "gpu-1", "display_name": "1 GPU", "gpus": 1},
    {"slug": "gpu-2", "display_name": "2 GPUs", "gpus": 2},
    {"slug": "gpu-4", "display_name": "4 GPUs", "gpus": 4},
    {"slug": "gpu-8", "display_name": "8 GPUs", "gpus": 8},
]
