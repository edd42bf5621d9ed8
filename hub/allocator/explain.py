"""Sentences saying why a request does not fit, for users to act on."""

from __future__ import annotations

from .model import MILLI, Request
from .state import ClusterState
from .units import fmt_gpus


def largest_block(
    links: tuple[str | None, ...], gpus: tuple[int, ...], allowed: list[int], nvlink: bool
) -> int:
    """Idle allowed GPUs of a node (in its largest NVLink group when ``nvlink``)."""
    idle = [p for p in allowed if gpus[p] == MILLI]
    if not nvlink:
        return len(idle)
    per: dict[str, int] = {}
    for p in idle:
        link = links[p]
        if link is not None:
            per[link] = per.get(link, 0) + 1
    return max(per.values(), default=0)


def explain_no_fit(state: ClusterState, request: Request) -> str:
    """Why ``request`` fits on no node right now: GPUs, or CPU/memory beside free GPUs."""
    cpu, mem, num_gpu, milli, models, nvlink = request.shape
    kind = "|".join(sorted(models)) + " " if models else ""
    largest = 0
    if nvlink:  # NVLink groups are not indexed: look at every node state
        for sid in state.groups:
            sig = state.sigs[sid]
            cls = state.classes[sig[0]]
            allowed = [p for p, m in enumerate(cls.models) if not models or m in models]
            largest = max(largest, largest_block(cls.nvlink, sig[3], allowed, True))
    else:
        # a node's capability is 1000 + idle GPUs, or its largest free share (see cap_of)
        for model, caps in state.model_caps.items():
            if models and model not in models:
                continue
            for cap in caps:
                largest = max(largest, cap - MILLI if num_gpu else min(cap, MILLI))
    if num_gpu and largest < num_gpu:
        link = "NVLinked " if nvlink else ""
        return (
            f"No node has {num_gpu} free {link}{kind}GPUs (largest free block: {largest}). "
            "Ask for fewer GPUs or try later."
        )
    if milli and largest >= milli and any(c.steps is not None for c in state.classes):
        # free milli is not enough where devices are cut into slices, replicas or steps
        takes = any(
            (t := cls.take(p, milli)) and f >= t and (not models or cls.models[p] in models)
            for sid in state.groups
            for cls, gpus in [(state.classes[state.sigs[sid][0]], state.sigs[sid][3])]
            for p, f in enumerate(gpus)
        )
        if not takes:
            return (
                f"No {kind}GPU slice or replica that holds {fmt_gpus(milli)} is free: this "
                "cluster hands out fractions as MIG instances, time-slicing replicas or HAMi "
                "splits, and those are taken. Ask for a different share or try later."
            )
    if milli and largest < milli:
        return (
            f"No {kind}GPU has {fmt_gpus(milli)} free (largest free share: {fmt_gpus(largest)}). "
            "Ask for a smaller share or try later."
        )
    return (
        f"No node with the requested GPUs also has {cpu / 1000:g} CPUs and {mem} MiB memory "
        "free. Ask for less CPU or memory, or try later."
    )
