"""Placement policies behind one interface (:class:`Policy`), looked up by name."""

from __future__ import annotations

from .base import Choice, Policy, ScoredPolicy
from .best_fit import BestFit
from .fgd import FGD
from .first_fit import FirstFit
from .gpulab import GpulabPolicy
from .random_fit import RandomFit

POLICIES: dict[str, type[Policy]] = {
    FirstFit.name: FirstFit,
    BestFit.name: BestFit,
    RandomFit.name: RandomFit,
    FGD.name: FGD,
    GpulabPolicy.name: GpulabPolicy,
}


def get_policy(name: str, seed: int | None = None) -> Policy:
    """Instantiate the policy called ``name`` (see ``POLICIES``)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"Unknown placement policy {name!r}; choose one of: {known}") from None
    return cls(seed=seed)


__all__ = [
    "POLICIES",
    "BestFit",
    "Choice",
    "FirstFit",
    "GpulabPolicy",
    "Policy",
    "RandomFit",
    "ScoredPolicy",
    "get_policy",
]
