"""A running server's GPU in a few words, for JupyterHub's own admin page.

JupyterHub's admin page (its React app) shows each server's model in the expanded row of the
user list, `user_options` included (and `state` only to holders of admin:server_state; the
"profile" column reads `user_options.profile`). So while a server holds a placement its spawner
puts a summary under `user_options["gpulab"]`:

    {"profile": "gpu-quarter", "gpu": "1/4 A100-SXM4-80GB", "node": "node-1",
     "devices": ["GPU 0: GPU-3f2a..."], "tier": "on-demand"}

The summary is the hub's, never the user's: it lives on the spawner's in-memory options only
(never in the database's copy, which JupyterHub reuses as the next start's options), it is
rebuilt from the placement after a hub restart, dropped when the share is released, and a start
whose options carry one (a client that copied a server's options into its next start) ignores
it: it is no option a user can set.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from gpulab.hub.allocator import Placement

#: the key of the hub-written summary in a server's user_options
GPU_SUMMARY_OPTION = "gpulab"


def gpu_label(shares: list[tuple[int, Any]]) -> str:
    """'1/4 A100-SXM4-80GB', '1 A100-SXM4-80GB', '2 x A100-SXM4-80GB', 'MIG 3g.40gb of
    A100-SXM4-80GB', 'none' from (milli, device) pairs (the device: model and mig_profile)."""
    if not shares:
        return "none"
    parts = []
    for milli, device in shares:
        if device.mig_profile:
            parts.append(f"MIG {device.mig_profile} of {device.model}")
        elif milli >= 1000 and milli % 1000 == 0:
            parts.append(f"{milli // 1000} {device.model}")
        else:
            parts.append(f"{Fraction(milli, 1000)} {device.model}")
    if len(set(parts)) == 1 and len(parts) > 1:
        whole = parts[0].partition(" ")[2] if parts[0].startswith("1 ") else parts[0]
        return f"{len(parts)} x {whole}"
    return ", ".join(parts)


def gpu_summary(
    profile: str | None, placement: Placement, device_of: Callable[[str], Any]
) -> dict[str, Any]:
    """The summary of `placement` (`device_of(uuid)`: the inventory's GPU, or KeyError)."""
    shares = []
    devices = []
    for share in placement.gpus:
        try:
            device = device_of(share.uuid)
        except KeyError:  # the inventory lost it (a node gone): say what is known
            devices.append(share.uuid)
            continue
        shares.append((share.milli, device))
        devices.append(f"GPU {device.index}: {share.uuid}")
    return {
        "profile": profile or placement.request.profile or "",
        "gpu": gpu_label(shares),
        "node": placement.node,
        "devices": devices,
        "tier": "preemptible" if placement.request.preemptible else "on-demand",
    }


def without_gpu_summary(options: Any) -> Any:
    """`options` less the hub's summary (as it was when it holds none)."""
    if isinstance(options, dict) and GPU_SUMMARY_OPTION in options:
        return {k: v for k, v in options.items() if k != GPU_SUMMARY_OPTION}
    return options
