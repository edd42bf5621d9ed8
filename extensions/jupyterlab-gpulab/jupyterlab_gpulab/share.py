"""The GPU share a server holds, as gpulab's spawner describes it in the server's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpulab.spawner.names import (
    GPU_DEVICE_MEMORY_MIB_ENV,
    GPU_ENFORCEMENT_ENV,
    GPU_FRACTION_ENV,
    GPU_INVENTORY_ENV,
    GPU_MEMORY_LIMIT_MIB_ENV,
    GPU_MODEL_ENV,
    GPU_UUIDS_ENV,
    PROFILE_ENV,
)

#: GPU_ENFORCEMENT_ENV of a server without a GPU (gpulab.spawner.environment.CPU_ONLY)
CPU_ONLY = "cpu-only"


@dataclass(frozen=True)
class Share:
    """Devices and limits of this server; parsed once from the environment at start."""

    uuids: tuple[str, ...]
    memory_limit_mib: float | None  # a fractional share's cap; None for whole devices
    fraction: float | None  # e.g. 0.25; None for whole devices
    enforcement: str
    profile: str
    user: str
    server: str
    model: str = ""  # as NVML names it, e.g. "A100-SXM4-80GB MIG 2g.20gb"; "" when unknown
    device_memory_mib: float | None = None
    inventory: str = ""  # "declared" / "simulated": nothing can measure these devices

    @property
    def cpu_only(self) -> bool:
        """The spawner gave this server no GPU: the monitor shows none, whatever it can see."""
        return self.enforcement == CPU_ONLY

    @property
    def whole(self) -> bool:
        """The server owns its devices outright (whole GPUs or its own MIG slice)."""
        return self.fraction is None and self.memory_limit_mib is None

    def to_json(self) -> dict[str, object]:
        return {
            "profile": self.profile,
            "fraction": self.fraction,
            "memory_limit_mib": self.memory_limit_mib,
            "enforcement": self.enforcement,
            "model": self.model,
        }


def is_mig_uuid(uuid: str) -> bool:
    """MIG devices are named `MIG-<uuid>` (R470+) or `MIG-GPU-<uuid>/<gi>/<ci>` (older drivers)."""
    return uuid.startswith("MIG-")


def _float_or_none(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not a number; gpulab's spawner sets e.g. {name}=0.250"
        ) from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def share_from_env(env: Mapping[str, str] | None = None) -> Share:
    """Read GPULAB_GPU_UUIDS, GPULAB_GPU_MEMORY_LIMIT_MIB, GPULAB_GPU_FRACTION and friends."""
    env = os.environ if env is None else env
    # the local spawner names the devices; on Kubernetes the device plugin does, in the
    # container's NVIDIA_VISIBLE_DEVICES ("void"/"none": no GPU; "all" names none in particular)
    listed = env.get(GPU_UUIDS_ENV, "") or env.get("NVIDIA_VISIBLE_DEVICES", "")
    if listed.strip().lower() in ("void", "none", "all"):
        listed = ""
    uuids = tuple(u.strip() for u in listed.split(",") if u.strip())
    fraction = _float_or_none(env, GPU_FRACTION_ENV)
    if fraction is not None and fraction >= 1:
        fraction = None  # a "share" of the whole device is the whole device
    return Share(
        uuids=tuple(dict.fromkeys(uuids)),  # de-duplicated, order kept
        memory_limit_mib=_float_or_none(env, GPU_MEMORY_LIMIT_MIB_ENV),
        fraction=fraction,
        enforcement=env.get(GPU_ENFORCEMENT_ENV, "") or ("exclusive" if uuids else "none"),
        profile=env.get(PROFILE_ENV, ""),
        user=env.get("JUPYTERHUB_USER", "") or _login_name(),
        server=env.get("JUPYTERHUB_SERVER_NAME", ""),
        model=env.get(GPU_MODEL_ENV, "").strip(),
        device_memory_mib=_float_or_none(env, GPU_DEVICE_MEMORY_MIB_ENV),
        inventory=env.get(GPU_INVENTORY_ENV, "").strip(),
    )


def _login_name() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return ""
